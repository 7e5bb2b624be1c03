"""What a stateful loss keeps across steps (R²VPO's dual variable λ): a dict the loss updates
after each optimizer step (rlvr.algos.inputs.StatefulLoss), saved in checkpoints."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from rlvr.algos import LOSSES
from rlvr.algos.inputs import StatefulLoss
from rlvr.train.methods.base import Method, SetupInfo, Plan

if TYPE_CHECKING:
    from rlvr.train.run import Run


class LossState(Method):
    state_key = "loss_state"

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, loss_state=self.values))

    def state_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.values.update(state)


def build(run: Run, info: SetupInfo) -> Method | None:
    return LossState() if isinstance(LOSSES[run.cfg.algo.loss], StatefulLoss) else None
