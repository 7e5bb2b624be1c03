"""RL on pre-training data (RLP): a thought is rewarded by the information it gives about the
text that follows.

Hatamizadeh et al., "RLP: Reinforcement as a Pretraining Objective", arXiv:2510.01265. A prompt
is a cut through a document (`rlvr.data.pretraining`): the context x_<t, then ``think_open``.
The policy samples a thought c. Its reward is the information gain on the target x_t..t+k (the
next ``target_words`` words, a task.params key of source "text"):

    r(c) = log p_θ(x_t..t+k | x_<t, c) − log p̄(x_t..t+k | x_<t)

The first term is the policy itself predicting the target after its thought (the thought closed
by ``think_close``). The second is a no-think baseline, an exponential moving average of
the policy: p̄ ← τ·p̄ + (1 − τ)·p_θ after every update (τ = ``ema_decay``, 0.999 in the
paper). Both are sums over the target's tokens, computed without gradient. The advantage is
group-relative over the G thoughts of a cut (GRPO), and only the thought's tokens are trained. So
the policy learns to write what helps it predict, and the EMA baseline rises with it.

In rlvr this is a reward, ``[[rewards]] fn = "information_gain"``, on ``task.source = "text"``.
Like the other rewards computed from the policy, it is filled in after sampling. Its parts
``<name>/with_thought`` and ``<name>/no_thought`` are logged too. The EMA model is saved in
checkpoints. It starts as the initial policy, `model`.
"""

from __future__ import annotations


import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rlvr.data import Example
from rlvr.data.chat import Tokenized, encode_text
from rlvr.lora import merged_state_dict
from rlvr.options import RLPOptions, rlp_options
from rlvr.data.pretraining import context_ids, prompt_ids  # noqa: F401  (prompt_ids: RLP's prompts, rendered by rlvr.train.data)
from rlvr.models import load_model
from rlvr.rewards.intrinsic import information_gain
from rlvr.train.logprobs import packed_batch, packed_logprobs
from rlvr.train.methods.base import Method, SetupInfo, Plan
from rlvr.types import Group

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run

@torch.no_grad()
def _target_logprob(model: Any, rows: list[tuple[list[int], int]], pad_token_id: int, micro_batch_size: int,
                    chunk: int) -> list[float]:
    """For each (ids, k): the summed log-prob of the last k tokens of ids given everything before."""
    device = next(model.parameters()).device
    out: list[float] = []
    for start in range(0, len(rows), micro_batch_size):
        part = [[Tokenized(tuple(ids), (0,) * (len(ids) - k) + (1,) * k)] for ids, k in rows[start : start + micro_batch_size]]
        out += packed_logprobs(model, packed_batch(part, pad_token_id, device), chunk).sum(-1).tolist()
    return out


def score_groups(run: Run, ema: PreTrainedModel, groups: list[Group], examples: list[Example]) -> list[Group]:
    """Fill in each sample's information-gain reward (see module docstring) and add it to its total.
    `examples` are the ones the groups' prompt indices point into."""
    rewards = [r for r in run.task.rewards if r.fn is information_gain]
    if not rewards:
        return groups
    cfg, tokenizer = rlp_options(run.cfg.rewards), run.tokenizer
    close = encode_text(tokenizer, cfg.think_close)
    pad, mb, chunk = run.engine.pad_token_id, run.settings.passes.micro_batch_size, run.settings.passes.logprob_chunk
    pred_rows, base_rows = [], []
    for g in groups:
        example = examples[g.samples[0].prompt_index]
        target = encode_text(tokenizer, example.fields["target"])
        base_rows.append((context_ids(tokenizer, example.fields["context"]) + target, len(target)))
        for x in g.samples:
            thought = list(x.completion.token_ids)
            closed = cfg.think_close and cfg.think_close in x.completion.text
            pred_rows.append((list(x.prompt_ids) + thought + ([] if closed else close) + target, len(target)))
    with_thought = iter(_target_logprob(run.learner.model, pred_rows, pad, mb, chunk))
    no_thought = _target_logprob(ema, base_rows, pad, mb, chunk)
    out = []
    for g, baseline in zip(groups, no_thought):
        scored = []
        for x in g.samples:
            predicted = next(with_thought)
            parts, total = dict(x.reward_parts), x.reward
            for r in rewards:
                parts[r.name] = predicted - baseline
                parts[f"{r.name}/with_thought"] = predicted
                parts[f"{r.name}/no_thought"] = baseline
                total += r.weight * parts[r.name]
            scored.append(dataclasses.replace(x, reward=total, reward_parts=parts))
        out.append(dataclasses.replace(g, samples=tuple(scored)))
    return out


@torch.no_grad()
def ema_update(ema: Any, policy: Any, decay: float) -> None:
    """p̄ ← decay·p̄ + (1 − decay)·p_θ, parameter by parameter."""
    current = merged_state_dict(policy)
    seen: set[int] = set()
    for name, value in ema.state_dict().items():
        if value.is_floating_point() and value.data_ptr() not in seen:  # tied weights appear under two names
            seen.add(value.data_ptr())
            value.mul_(decay).add_(current[name].to(value.dtype), alpha=1 - decay)


class RLP(Method):
    """Scores thoughts by their information gain (training and held-out), and moves the EMA
    baseline toward the policy after every update."""

    state_key = "ema"

    def __init__(self, ema: PreTrainedModel, options: RLPOptions) -> None:
        self.ema, self.options = ema, options

    def rescore(self, run: Run, groups: list[Group], examples: list[Example], held_out: bool) -> list[Group]:
        return score_groups(run, self.ema, groups, examples)

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        ema_update(self.ema, run.learner.model, self.options.ema_decay)
        return {}

    def state_dict(self) -> dict[str, Any]:
        return dict(self.ema.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ema.load_state_dict(state)


def check(cfg: RunConfig) -> None:
    """RL on pre-training data: the text source and the information_gain reward go together, and
    its EMA baseline is updated from the policy each step (run when a run opens)."""
    gain = any(r.fn == "information_gain" for r in cfg.rewards)
    if gain != (cfg.task.source == "text"):
        raise ValueError("RL on pre-training data pairs task.source = \"text\" with the reward "
                         "fn = \"information_gain\": set both (configs/rlp.toml)")
    if gain:
        rlp_options(cfg.rewards)
        if cfg.dist.async_options() is not None:
            raise ValueError("dist.async_rollouts does not combine with the information_gain reward: its EMA "
                             "baseline follows the policy being trained")


def build(run: Run, info: SetupInfo) -> Method | None:
    if not any(r.fn is information_gain for r in run.task.rewards):
        return None
    return RLP(load_model(run.cfg.model, info.dtype, info.device).eval().requires_grad_(False), rlp_options(run.cfg.rewards))
