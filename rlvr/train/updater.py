"""Who runs a step's update, and how its weights reach the engine.

`Updater` runs `update_policy` here, with the run's own random stream for the mini-batch order;
rlvr.scaleout.learners.DataParallel runs the same update on every rank of data-parallel
learners. The loop asks neither which one it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlvr.lora import merged_state_dict
from rlvr.rollout.engine import Engine
from rlvr.rollout.probe import check, tolerance
from rlvr.train.learner import Learner
from rlvr.train.logprobs import token_logprobs
from rlvr.train.update import UpdateResult, UpdateSettings, update_policy
from rlvr.types import Group

if TYPE_CHECKING:
    from rlvr.train.update import Extras


class Updater:
    def __init__(self, learner: Learner, *, pad_token_id: int, seed: int, shared_weights: bool,
                 probe_ids: list[int] | None = None) -> None:
        self.learner, self.pad_token_id = learner, pad_token_id
        self.generator = torch.Generator().manual_seed(seed)
        """The order of the mini-batches (checkpointed)."""
        self.shared_weights = shared_weights
        """The engine samples from the learner's own model: nothing to copy after an update."""
        self.probe_ids = probe_ids or []
        """The tokens an engine with its own copy of the weights scores after every sync (rlvr.rollout.probe)."""
        self.probe_gap: float | None = None
        """The last probe's mean |Δ log-prob| between the engine and the learner, or None (not probed)."""

    def update(self, groups: list[Group], settings: UpdateSettings, extras: Extras) -> UpdateResult:
        return update_policy(self.learner, groups, settings, pad_token_id=self.pad_token_id,
                             generator=self.generator, **extras.keywords())

    def sync(self, engine: Engine) -> None:
        """The engine samples the updated policy from now on; an engine that can be probed
        (rlvr.rollout.probe) is checked to compute what the learner does."""
        if self.shared_weights:
            return
        engine.update_weights(merged_state_dict(self.learner.model))
        probe = getattr(engine, "probe", None)
        if probe is None or not self.probe_ids:
            return
        scored = probe(self.probe_ids)
        if scored:
            model = self.learner.model
            dtypes = (next(model.parameters()).dtype, getattr(engine, "dtype", torch.bfloat16))
            self.probe_gap = check(scored, learner_probe(model, self.probe_ids), tolerance(*dtypes), engine.version)

    def checkpoint(self, folder: Path) -> dict[str, Any]:
        """Write what this updater keeps outside the driver into the checkpoint being written in
        ``folder`` (sharded learners' shares: rlvr.scaleout.sharded); returns entries for its training state."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"update_rng": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["update_rng"])

    def close(self) -> None:
        pass


@torch.no_grad()
def learner_probe(model: torch.nn.Module, ids: list[int]) -> list[float]:
    """The log-probs of ``ids[1:]`` as the learner scores tokens for its loss (`token_logprobs`),
    in eval mode (no dropout): what an engine's probe is held to (rlvr.rollout.probe)."""
    device = next(model.parameters()).device
    ids_BT = torch.tensor([ids], device=device)
    target_BT = torch.ones_like(ids_BT)
    target_BT[:, 0] = 0
    training = model.training
    model.eval()
    try:
        logprobs_BT, _ = token_logprobs(model, ids_BT, torch.ones_like(ids_BT), target_BT)  # type: ignore[arg-type]
    finally:
        model.train(training)
    return [float(x) for x in logprobs_BT[0, 1:].float().cpu()]
