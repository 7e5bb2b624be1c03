"""Schedules over a run's steps: staged generation lengths, and shaping that starts late.

- ``sampling.length_schedule = [[1, 64], [20, 128]]``: each step samples with the budget of the
  last stage that has begun (AceReason-Nemotron's stage-wise length extension: Chen et al.,
  "AceReason-Nemotron: Advancing Math and Code Reasoning through Reinforcement Learning",
  arXiv:2505.16400). The update's length constant (overlong shaping's L_max, Dr.GRPO's
  normaliser) follows the budget its samples were drawn with. Held-out evaluation keeps
  ``sampling.max_new_tokens``, the longest.
- ``algo.shaping = [{fn = "kimi_length", from_step = 10}]``: a shaping function applies from its
  step on. Kimi k1.5 (arXiv:2501.12599, §2.3.3) found its length penalty slowed early training
  and warmed it up so: plain RL first, then the penalty at its constant weight.

Both are this method's hooks (`sampling` before the step's rollouts, `prepare` before its
update); the step names neither.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from rlvr.train.methods.base import Method, Plan, SetupInfo
from rlvr.types import SamplingParams

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


def stage_budget(stages: list[tuple[int, int]], step: int, default: int) -> int:
    """The budget of the last stage begun by ``step`` (``default`` without stages)."""
    budget = default
    for start, tokens in stages:
        if step >= start:
            budget = tokens
    return budget


class Schedules(Method):
    def __init__(self, stages: list[tuple[int, int]], starts: list[int]) -> None:
        self.stages, self.starts = stages, starts

    def sampling(self, params: SamplingParams, step: int) -> SamplingParams:
        return dataclasses.replace(params, max_new_tokens=stage_budget(self.stages, step, params.max_new_tokens))

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        s = plan.settings
        shaping = tuple(spec for spec, start in zip(s.advantage.shaping, self.starts) if step >= start)
        loss = dataclasses.replace(s.loss, max_tokens=stage_budget(self.stages, step, s.loss.max_tokens))
        settings = dataclasses.replace(s, advantage=dataclasses.replace(s.advantage, shaping=shaping), loss=loss)
        return dataclasses.replace(plan, settings=settings)


def build(run: Run, info: SetupInfo) -> Schedules | None:
    cfg = run.cfg
    starts = [spec.from_step for spec in cfg.algo.shaping]
    if not cfg.sampling.length_schedule and all(start == 1 for start in starts):
        return None
    return Schedules([(start, tokens) for start, tokens in cfg.sampling.length_schedule], starts)


def check(cfg: RunConfig) -> None:
    """Staged lengths are single-turn budgets: an episode's are env's limits."""
    if cfg.sampling.length_schedule and cfg.env.name:
        raise ValueError("sampling.length_schedule stages a single completion's budget; an episode's budget is "
                         "env.max_total_tokens and sampling.max_new_tokens per turn: leave the schedule out with "
                         "env.name")
