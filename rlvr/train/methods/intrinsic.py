"""Rewards from the policy's own distributions (rlvr.rewards.intrinsic: self-certainty, negative
entropy), filled in after sampling with one no-gradient pass of the policy over the completions.
Training only: held-out evaluation scores the task's rewards."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlvr.data import Example
from rlvr.rewards import RewardFn
from rlvr.train.methods.base import Method, SetupInfo
from rlvr.rewards.intrinsic import INTRINSIC, information_gain
from rlvr.train.batches import score_certainty
from rlvr.types import Group

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class IntrinsicRewards(Method):
    def __init__(self, rewards: list[RewardFn]) -> None:
        self.rewards = rewards

    def rescore(self, run: Run, groups: list[Group], examples: list[Example], held_out: bool) -> list[Group]:
        if held_out:
            return groups
        samples = [x for g in groups for x in g.samples]
        p = run.settings.passes
        certainty, negative_entropy = score_certainty(run.learner.model, samples, run.engine.pad_token_id,
                                                      temperature=p.temperature, micro_batch_size=p.micro_batch_size,
                                                      chunk_size=p.logprob_chunk)
        out, k = [], 0
        for g in groups:
            scored = []
            for x in g.samples:
                parts = dict(x.reward_parts)
                total = x.reward
                for r in self.rewards:
                    parts[r.name] = r.fn(float(certainty[k]), float(negative_entropy[k]))
                    total += r.weight * parts[r.name]
                scored.append(dataclasses.replace(x, reward=total, reward_parts=parts))
                k += 1
            out.append(dataclasses.replace(g, samples=tuple(scored)))
        return out


def check(cfg: RunConfig) -> None:
    """Intrinsic rewards are computed from the policy itself (run when a run opens)."""
    from_policy = [r.fn for r in cfg.rewards if r.fn in INTRINSIC]
    if from_policy and cfg.dist.async_options() is not None:
        raise ValueError("dist.async_rollouts does not combine with rewards computed from the policy being "
                         f"trained while rollouts are collected: {', '.join(map(repr, from_policy))}")


def build(run: Run, info: SetupInfo) -> Method | None:
    rewards = [r for r in run.task.rewards if r.intrinsic and r.fn is not information_gain]  # RLP's: methods.rlp
    return IntrinsicRewards(rewards) if rewards else None
