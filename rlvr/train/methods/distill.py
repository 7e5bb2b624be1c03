"""On-policy distillation (``algo.advantage = "opd"``): a frozen teacher scores the tokens the
student sampled, and each token's advantage is its reverse-KL term
(rlvr.algos.distill.reverse_kl_advantages), optionally plus the outcome advantage.

It plugs into the update through the `Credit` seam, as PPO's critic does, with nothing to train:
`advantages` scores the samples under the teacher; `backward` and `step` do nothing.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rlvr.algos.distill import OpdOptions, reverse_kl_advantages
from rlvr.models import load_model, load_tokenizer
from rlvr.train.advantages import outcome_advantages
from rlvr.train.batches import score_logprobs
from rlvr.algos import PER_TOKEN
from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo
from rlvr.train.settings import UpdateSettings, outcome_settings
from rlvr.types import Group, Sample

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class TeacherCredit:
    """The reverse KL to a frozen teacher as per-token advantages: rlvr.train.update.Credit.

    The student's log-probs are the engine's, of the very tokens it sampled (no extra forward
    pass), where the engine samples from the policy's whole distribution at the temperature. Where
    it samples from a truncated one (top_p < 1, top_k > 0, tokens it never samples), the engine's
    log-probs are those of the renormalised distribution, log π − log S for the kept mass S, and
    every advantage would shift by −log S: ``student`` (the policy being trained) then scores the
    tokens instead, as the teacher does."""

    def __init__(self, teacher: PreTrainedModel, options: OpdOptions, student: PreTrainedModel | None = None) -> None:
        self.teacher, self.options, self.student = teacher, options, student
        self._metrics: dict[str, float] = {}

    def advantages(self, groups: list[Group], samples: list[Sample], kept: set[int], rewards_PG: torch.Tensor,
                   kl_N: list[torch.Tensor] | None, s: UpdateSettings, pad_token_id: int) -> list[torch.Tensor]:
        o = self.options
        outcome_B = None
        if o.outcome_weight:
            if len(samples) != sum(len(g.samples) for g in groups):
                raise ValueError("summarised episodes (env.summarize) train with the episode's outcome advantage: "
                                 "advantage = \"opd\" with outcome_weight > 0 is not supported with them")
            outcome_s = outcome_settings(s, o.outcome)
            outcome_B = outcome_advantages(groups, rewards_PG, outcome_s).flatten()
        # the teacher scores the sampled tokens at the sampling temperature (not those an
        # environment injected: both are 0 there, and so is the advantage); the student is the
        # engine's log-probs, or the policy's own where the engine's are of a truncated distribution
        teacher = score_logprobs(self.teacher, samples, s, pad_token_id, kept)
        scored = None if self.student is None else score_logprobs(self.student, samples, s, pad_token_id, kept)
        out, reverse_kl = [], []
        for i, x in enumerate(samples):
            n = len(x.completion.token_ids)
            if i not in kept:
                out.append(torch.zeros(n))
                continue
            student_N = (torch.tensor(x.completion.logprobs, dtype=torch.float32) if scored is None
                         else scored[i].float().cpu())
            advantage_N = reverse_kl_advantages(student_N, teacher[i].float().cpu(), coef=o.coef)
            if kl_N is not None:  # a KL to the reference in the reward: per token, as GAE has it
                advantage_N = advantage_N - s.kl.coef * kl_N[i]
            if outcome_B is not None:
                advantage_N = advantage_N + o.outcome_weight * float(outcome_B[i])
            out.append(advantage_N)
            trained = torch.tensor(x.completion.loss_mask or (1,) * n, dtype=torch.bool)
            if trained.any():
                reverse_kl.append(float((student_N - teacher[i].float().cpu())[trained].mean()))
        self._metrics = {"opd/reverse_kl": statistics.fmean(reverse_kl)} if reverse_kl else {}
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


def teacher_credit(cfg: RunConfig, policy: PreTrainedModel, tokenizer_spec: str | None = None,
                   banned: bool = False) -> TeacherCredit | None:
    """The teacher's credit when ``cfg`` asks for on-policy distillation, else None. The teacher
    is loaded frozen, in the policy's dtype and on its device, and must share its tokenizer's
    vocabulary (checked against ``tokenizer_spec``, the run's model, when given). Where the
    engine samples from a truncated distribution (sampling.top_p < 1, top_k > 0, or ``banned``
    tokens it never samples: a VLM's image placeholders), the policy scores the student's tokens
    (`TeacherCredit`)."""
    a = cfg.algo
    if PER_TOKEN.get(a.advantage) is not OpdOptions:
        return None
    options = OpdOptions(**a.advantage_kwargs)
    weight = next(policy.parameters())
    teacher = load_model(options.teacher, weight.dtype, weight.device).eval().requires_grad_(False)
    if tokenizer_spec is not None and load_tokenizer(options.teacher).get_vocab() != load_tokenizer(tokenizer_spec).get_vocab():
        raise ValueError(f"algo.advantage_kwargs.teacher {options.teacher!r} has another tokenizer than the model "
                         f"{tokenizer_spec!r}: on-policy distillation scores the student's own token ids")
    truncated = cfg.sampling.top_p < 1.0 or cfg.sampling.top_k > 0 or banned
    return TeacherCredit(teacher, options, student=policy if truncated else None)


class Distillation(Method):
    def __init__(self, credit: TeacherCredit) -> None:
        self.credit = credit

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, credit=self.credit))


def on_rank(cfg: RunConfig, policy: PreTrainedModel, info: RankInfo) -> Extras | None:
    credit = teacher_credit(cfg, policy, cfg.model, banned=info.banned)
    return None if credit is None else Extras(credit=credit)


def build(run: Run, info: SetupInfo) -> Method | None:
    extras = on_rank(run.cfg, run.learner.model, RankInfo.of(run, info))
    return None if extras is None else Distillation(extras.credit)  # type: ignore[arg-type]
