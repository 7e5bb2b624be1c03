"""ReMax's baseline: the reward of one greedy completion per prompt (a greedy episode when the
task is an environment), sampled before the update, for an estimator marked `rlvr.algos.advantages.greedy_baseline`
(`remax` subtracts it).

Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
Aligning Large Language Models", arXiv:2310.10505.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING

from rlvr.algos import ESTIMATORS
from rlvr.algos.advantages import wants_greedy
from rlvr.train.methods.base import Method, SetupInfo, Plan
from rlvr.train.rollouts import generate_groups

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class GreedyBaseline(Method):
    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        task = run.task
        greedy_params = dataclasses.replace(task.params, temperature=0.0, top_k=0, top_p=1.0, n=1)
        indices = [g.samples[0].prompt_index for g in plan.groups]
        if task.episodes is not None:
            greedy = task.episodes(run.engine, task.examples, indices, 1, sampling=greedy_params)
        else:
            greedy = generate_groups(run.engine, task.examples, task.prompt_ids, indices, task.rewards, greedy_params,
                                     media=task.media)
        groups = [dataclasses.replace(g, greedy_reward=b.samples[0].reward)
                  for g, b in zip(plan.groups, greedy)]
        return dataclasses.replace(plan, groups=groups, own=groups[: len(plan.own)])

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        return {"greedy_reward": statistics.fmean(g.greedy_reward or 0.0 for g in plan.groups)}


def _greedy(cfg: RunConfig) -> bool:
    estimator = ESTIMATORS.get(cfg.algo.advantage)
    return estimator is not None and wants_greedy(estimator)


def check(cfg: RunConfig) -> None:
    """The greedy baseline is sampled from the policy at the step (run when a run opens)."""
    if _greedy(cfg) and cfg.dist.async_options() is not None:
        raise ValueError("dist.async_rollouts does not combine with a greedy baseline "
                         f"(advantage = {cfg.algo.advantage!r}): it is sampled from the policy being trained")


def build(run: Run, info: SetupInfo) -> Method | None:
    return GreedyBaseline() if _greedy(run.cfg) else None
