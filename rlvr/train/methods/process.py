"""Process supervision (``algo.advantage = "process"``): a process reward model scores each
reasoning step of every completion, and the group-normalised step scores become per-token
advantages (rlvr.algos.process.process_advantages, DeepSeekMath's process supervision),
optionally plus the outcome advantage.

It plugs into the update through the `Credit` seam: `advantages` splits the completions into
steps, asks the PRM, and places each step's normalised score on the tokens up to its end;
nothing is trained beside the policy. With ``credit = "gae"`` the step scores are instead rewards
on each step's last token for PPO's critic and GAE (rlvr.train.methods.ppo), whose critic is
trained and checkpointed as PPO's is.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlvr.algos.process import ProcessOptions, process_advantages, split_steps, step_end_tokens, step_text
from rlvr.rewards.process import PRM, load_prm
from rlvr.train.advantages import outcome_advantages
from rlvr.algos import PER_TOKEN
from rlvr.algos.registry import options as checked  # as checked: `options` here is a ProcessOptions
from rlvr.options import GaeOptions
from rlvr.train.methods.ppo import CriticCredit, new_critic
from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo
from rlvr.train.settings import UpdateSettings, outcome_settings
from rlvr.types import Group, Sample

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class StepScorer:
    """The step scores of a batch of samples: each completion split on the delimiter, each step's
    last token located, the PRM asked once for the whole batch. ``fields_of(group)`` gives the
    fields of the group's example (what a function PRM receives as keywords, as a reward function
    does). Keeps the last call's metrics."""

    def __init__(self, prm: PRM, options: ProcessOptions, tokenizer: Any,
                 fields_of: Callable[[Group], dict[str, Any]] | None = None) -> None:
        self.prm, self.options, self.tokenizer = prm, options, tokenizer
        self.fields_of = fields_of or (lambda g: {"answer": g.metadata.get("answer")})
        self.metrics: dict[str, float] = {}

    def __call__(self, groups: list[Group], samples: list[Sample],
                 kept: set[int]) -> tuple[list[list[float]], list[list[int]]]:
        if len(samples) != sum(len(g.samples) for g in groups) or any(x.completion.turn_index for x in samples):
            raise ValueError("advantage = \"process\" scores the reasoning steps of single-turn completions: "
                             "multi-turn episodes (env.name) are not supported")
        prompts, steps, examples, ends = [], [], [], []
        for g in groups:
            fields = self.fields_of(g)
            for x in g.samples:
                spans = split_steps(x.completion.text, self.options.delimiter) or [(0, 0)]  # empty: one empty step
                prompts.append(g.prompt)
                steps.append([step_text(x.completion.text, span, self.options.delimiter) for span in spans])
                examples.append(fields)
                ends.append(step_end_tokens(self.tokenizer, x.completion.token_ids, spans)
                            if x.completion.token_ids else [])
        scores = self.prm.score(prompts, steps, examples)
        every = [v for i in kept for v in scores[i]]
        self.metrics = {"process/step_score": statistics.fmean(every),
                        "process/steps": statistics.fmean(len(scores[i]) for i in kept)} if every else {}
        return scores, ends


class ProcessCredit:
    """Step scores as group-normalised per-token advantages (credit = "group"):
    rlvr.train.update.Credit, with nothing to train."""

    reads_fields = True
    """Its PRM gets each group's example fields (`fields_of`): data-parallel ranks are sent them."""

    def __init__(self, prm: PRM, options: ProcessOptions, tokenizer: Any,
                 fields_of: Callable[[Group], dict[str, Any]] | None = None) -> None:
        self.scorer = StepScorer(prm, options, tokenizer, fields_of)
        self.options = options

    def advantages(self, groups: list[Group], samples: list[Sample], kept: set[int], rewards_PG: torch.Tensor,
                   kl_N: list[torch.Tensor] | None, s: UpdateSettings, pad_token_id: int) -> list[torch.Tensor]:
        o = self.options
        scores, ends = self.scorer(groups, samples, kept)
        outcome_B = None
        if o.outcome_weight:
            outcome_B = outcome_advantages(groups, rewards_PG, outcome_settings(s, o.outcome)).flatten()
        out: list[torch.Tensor] = []
        first = 0
        for g in groups:
            rows = range(first, first + len(g.samples))
            # the group's samples left out of the loss do not set its step-score baseline
            mine = [i for i in rows if i in kept and samples[i].completion.token_ids]
            per_row = process_advantages([scores[i] for i in mine], [ends[i] for i in mine],
                                         [len(samples[i].completion.token_ids) for i in mine],
                                         form="min" if o.credit == "min" else "sum")
            advantages = dict(zip(mine, per_row))
            for i in rows:
                a = advantages.get(i, torch.zeros(len(samples[i].completion.token_ids)))
                if i in advantages and kl_N is not None:
                    a = a - s.kl.coef * kl_N[i]
                if i in advantages and outcome_B is not None:
                    a = a + o.outcome_weight * float(outcome_B[i])
                out.append(a)
            first += len(g.samples)
        return out

    def backward(self, batch: dict[str, torch.Tensor], micro: list[int], s: UpdateSettings,
                 totals: dict[str, float], sums: dict[str, float]) -> dict[str, torch.Tensor]:
        return {}

    def step(self) -> None:
        pass

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        return dict(self.scorer.metrics)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class StepRewardCritic(CriticCredit):
    """Step scores as rewards on each step's last token, for PPO's critic and GAE (credit = "gae");
    outcome_weight × the (shaped) outcome reward sits on the last token."""

    reads_fields = True
    """As ProcessCredit's."""

    def __init__(self, critic: CriticCredit, scorer: StepScorer) -> None:
        super().__init__(critic.critic, critic.options, self._placed)
        self.scorer = scorer

    def _placed(self, groups: list[Group], samples: list[Sample], kept: set[int],
                rewards_PG: torch.Tensor) -> list[list[tuple[int, float]] | None]:
        scores, ends = self.scorer(groups, samples, kept)
        rewards_B, w = rewards_PG.flatten(), self.scorer.options.outcome_weight
        out: list[list[tuple[int, float]] | None] = []
        for i, x in enumerate(samples):
            n = len(x.completion.token_ids)
            out.append([*zip(ends[i], scores[i]), *([(n - 1, w * float(rewards_B[i]))] if w and n else [])])
        return out

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        return super().summarise(sums) | self.scorer.metrics


def process_credit(cfg: RunConfig, policy: Any, tokenizer: Any, optimizer_steps: int = 1,
                   fields_of: Callable[[Group], dict[str, Any]] | None = None) -> ProcessCredit | StepRewardCritic | None:
    """The PRM's credit when ``cfg`` asks for process supervision, else None: group-normalised
    step advantages, or (credit = "gae") a critic initialised from the policy. A model PRM is
    loaded frozen in the policy's dtype and on its device."""
    if PER_TOKEN.get(cfg.algo.advantage) is not ProcessOptions:
        return None
    options = ProcessOptions(**cfg.algo.advantage_kwargs)
    weight = next(policy.parameters())
    prm = load_prm(options.prm, options.separator, weight.dtype, weight.device)
    if options.credit in ("group", "min"):
        return ProcessCredit(prm, options, tokenizer, fields_of)
    gae = checked("algo.advantage_kwargs.gae", GaeOptions, options.gae)
    return StepRewardCritic(new_critic(cfg, policy, optimizer_steps, gae), StepScorer(prm, options, tokenizer, fields_of))


class ProcessSupervision(Method):
    def __init__(self, credit: ProcessCredit | StepRewardCritic) -> None:
        self.credit = credit
        if isinstance(credit, StepRewardCritic):  # the critic's weights and optimizer are part of every checkpoint
            self.state_key, self.state_required = "critic", True

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, credit=self.credit))

    def state_dict(self) -> dict[str, Any]:
        return self.credit.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.credit.load_state_dict(state)


def on_rank(cfg: RunConfig, policy: Any, info: RankInfo) -> Extras | None:
    credit = process_credit(cfg, policy, info.tokenizer, info.optimizer_steps, info.fields_of)
    return None if credit is None else Extras(credit=credit)


def build(run: Run, info: SetupInfo) -> Method | None:
    extras = on_rank(run.cfg, run.learner.model, RankInfo.of(run, info))
    return None if extras is None else ProcessSupervision(extras.credit)  # type: ignore[arg-type]
