"""PPO's learned critic (advantage = "gae"): a value model trained beside the policy. Its values
enter GAE's per-token advantages, its clipped value loss is minimised in the same micro-batches
as the policy loss, and it steps with the policy (rlvr.train.update). Its model and optimizer
are part of every checkpoint."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlvr.algos import ESTIMATORS
from rlvr.algos.registry import loop_inputs
from rlvr.train.critic import Critic
from rlvr.train.learner import Learner
from rlvr.train.methods import Method, SetupInfo, Plan

if TYPE_CHECKING:
    from rlvr.train.run import Run


class CriticMethod(Method):
    state_key = "critic"
    state_required = True

    def __init__(self, critic: Learner) -> None:
        self.critic = critic

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, critic=self.critic))

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.critic.model.state_dict(), "learner": self.critic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.critic.model.load_state_dict(state["model"])
        self.critic.load_state_dict(state["learner"])


def build(run: Run, info: SetupInfo) -> Method | None:
    a, tr = run.cfg.algo, run.cfg.train
    if "values_BT" not in loop_inputs(ESTIMATORS[a.advantage]):
        return None
    return CriticMethod(Learner(Critic(run.learner.model), lr=a.critic_lr, betas=tr.betas,
                                weight_decay=tr.weight_decay, grad_clip=tr.grad_clip, warmup_steps=tr.warmup_steps,
                                total_steps=info.optimizer_steps, schedule=tr.schedule))
