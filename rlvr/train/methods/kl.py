"""The KL term's reference model and coefficient: fixed (algo.kl_coef), or adaptive in the
reward (kl_placement = "reward" with algo.kl_adaptive: rlvr.algos.kl.KLController, the PPO-RLHF
controller of Ziegler et al., arXiv:1909.08593), updated after each step from the step's KL."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel

from rlvr.algos.kl import AdaptiveKL, KLController
from rlvr.attention import EXACT, exact_attention
from rlvr.models import load_policy
from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class Reference(Method):
    state_key = "kl"

    def __init__(self, ref_model: PreTrainedModel, controller: KLController) -> None:
        self.ref_model, self.controller = ref_model, controller

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        settings = plan.settings
        if self.controller.target is not None:  # the adaptive coefficient of this step
            settings = dataclasses.replace(settings, kl=dataclasses.replace(settings.kl, coef=self.controller.value))
        return dataclasses.replace(plan, settings=settings,
                                   extras=dataclasses.replace(plan.extras, ref_model=self.ref_model))

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        if "kl_reward" in metrics:
            self.controller.update(metrics["kl_reward"], n=sum(len(g.samples) for g in plan.groups))
        return {}

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)


def on_rank(cfg: Any, policy: PreTrainedModel, info: RankInfo) -> Extras | None:
    """The frozen reference model (the run's model as loaded, in the policy's dtype and on its device)."""
    if cfg.algo.kl_coef <= 0:
        return None
    weight = next(policy.parameters())
    ref = load_policy(cfg.model, weight.dtype, weight.device)[0].eval().requires_grad_(False)
    if getattr(getattr(policy, "config", None), "_attn_implementation", None) == EXACT:
        exact_attention(ref)  # matched numerics (rlvr.rollout.matched): the reference computes as the policy does
    return Extras(ref_model=ref)


def check(cfg: RunConfig) -> None:
    """A KL in the reward needs whole episodes (run when a run opens, before the model loads)."""
    if cfg.env.summarize and cfg.algo.kl_placement == "reward" and cfg.algo.kl_coef > 0:
        raise ValueError("env.summarize trains segments with the episode's outcome advantage: it does not "
                         "combine with a KL in the reward (algo.kl_placement = \"reward\")")


def build(run: Run, info: SetupInfo) -> Method | None:
    a = run.cfg.algo
    extras = on_rank(run.cfg, run.learner.model, RankInfo.of(run, info))
    if extras is None:
        return None
    ref_model = extras.ref_model
    assert ref_model is not None
    if a.kl_adaptive:
        adaptive = AdaptiveKL(**a.kl_adaptive)
        return Reference(ref_model, KLController(a.kl_coef, adaptive.target, adaptive.horizon))
    return Reference(ref_model, KLController(a.kl_coef))
