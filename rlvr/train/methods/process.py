"""Process supervision (``algo.advantage = "process"``): a process reward model scores each
reasoning step of every completion, and the group-normalised step scores become per-token
advantages (rlvr.algos.process.process_advantages, DeepSeekMath's process supervision),
optionally plus the outcome advantage.

It plugs into the update through the `Credit` seam: `advantages` splits the completions into
steps, asks the PRM, and places each step's normalised score on the tokens up to its end;
nothing is trained beside the policy.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlvr.algos.process import ProcessOptions, process_advantages, split_steps, step_end_tokens
from rlvr.rewards.process import PRM, load_prm
from rlvr.train.advantages import outcome_advantages
from rlvr.train.critic import PER_TOKEN
from rlvr.train.methods import Method, Plan, SetupInfo
from rlvr.train.settings import UpdateSettings
from rlvr.types import Group, Sample

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class ProcessCredit:
    """Step scores from a PRM as per-token advantages: rlvr.train.update.Credit.

    ``fields_of(group)`` gives the fields of the group's example (what a function PRM receives as
    keywords, as a reward function does)."""

    def __init__(self, prm: PRM, options: ProcessOptions, tokenizer: Any,
                 fields_of: Callable[[Group], dict[str, Any]] = lambda g: {"answer": g.metadata.get("answer")}) -> None:
        self.prm, self.options, self.tokenizer, self.fields_of = prm, options, tokenizer, fields_of
        self._metrics: dict[str, float] = {}

    def advantages(self, groups: list[Group], samples: list[Sample], kept: set[int], rewards_PG: torch.Tensor,
                   kl_N: list[torch.Tensor] | None, s: UpdateSettings, pad_token_id: int) -> list[torch.Tensor]:
        o = self.options
        if len(samples) != sum(len(g.samples) for g in groups) or any(x.completion.turn_index for x in samples):
            raise ValueError("advantage = \"process\" scores the reasoning steps of single-turn completions: "
                             "multi-turn episodes (env.name) are not supported")
        outcome_B = None
        if o.outcome_weight:
            outcome_B = outcome_advantages(groups, rewards_PG, dataclasses.replace(s, advantage=o.outcome,
                                                                                  advantage_kwargs={})).flatten()
        prompts, steps, examples, ends = [], [], [], []
        for g in groups:
            fields = self.fields_of(g)
            for x in g.samples:
                spans = split_steps(x.completion.text, o.delimiter) or [(0, 0)]  # an empty completion: one empty step
                prompts.append(g.prompt)
                steps.append([x.completion.text[a:b] for a, b in spans])
                examples.append(fields)
                ends.append(step_end_tokens(self.tokenizer, x.completion.token_ids, spans)
                            if x.completion.token_ids else [])
        scores = self.prm.score(prompts, steps, examples)
        out: list[torch.Tensor] = []
        first = 0
        for g in groups:
            rows = range(first, first + len(g.samples))
            # the group's samples left out of the loss do not set its step-score baseline
            mine = [i for i in rows if i in kept and samples[i].completion.token_ids]
            per_row = process_advantages([scores[i] for i in mine], [ends[i] for i in mine],
                                         [len(samples[i].completion.token_ids) for i in mine])
            advantages = dict(zip(mine, per_row))
            for i in rows:
                a = advantages.get(i, torch.zeros(len(samples[i].completion.token_ids)))
                if i in advantages and kl_N is not None:
                    a = a - s.kl_coef * kl_N[i]
                if i in advantages and outcome_B is not None:
                    a = a + o.outcome_weight * float(outcome_B[i])
                out.append(a)
            first += len(g.samples)
        every = [v for i in kept for v in scores[i]]
        self._metrics = {"process/step_score": statistics.fmean(every),
                         "process/steps": statistics.fmean(len(scores[i]) for i in kept)} if every else {}
        return out

    def backward(self, batch: dict[str, torch.Tensor], micro: list[int], s: UpdateSettings,
                 totals: dict[str, float], sums: dict[str, float]) -> dict[str, torch.Tensor]:
        return {}

    def step(self) -> None:
        pass

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(self._metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def process_credit(cfg: RunConfig, policy: Any, tokenizer: Any,
                   fields_of: Callable[[Group], dict[str, Any]] | None = None) -> ProcessCredit | None:
    """The PRM's credit when ``cfg`` asks for process supervision, else None. A model PRM is
    loaded frozen in the policy's dtype and on its device."""
    if PER_TOKEN.get(cfg.algo.advantage) is not ProcessOptions:
        return None
    options = ProcessOptions(**cfg.algo.advantage_kwargs)
    weight = next(policy.parameters())
    prm = load_prm(options.prm, options.separator, weight.dtype, weight.device)
    if fields_of is None:
        return ProcessCredit(prm, options, tokenizer)
    return ProcessCredit(prm, options, tokenizer, fields_of)


class ProcessSupervision(Method):
    def __init__(self, credit: ProcessCredit) -> None:
        self.credit = credit

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, credit=self.credit))


def build(run: Run, info: SetupInfo) -> Method | None:
    by_id = {ex.id: ex for ex in run.task.examples}

    def fields_of(group: Group) -> dict[str, Any]:
        example = by_id.get(group.metadata.get("id"))  # type: ignore[arg-type]
        return dict(example.fields) if example is not None else {"answer": group.metadata.get("answer")}

    credit = process_credit(run.cfg, run.learner.model, run.tokenizer, fields_of)
    return None if credit is None else ProcessSupervision(credit)
