"""Training methods composed beside the core step (rlvr.train.loop.train_step).

The core step names no method: it collects groups, updates the policy, hands the new weights to
the engine, lets the sampler observe, and logs. A method whose data flow differs plugs in
through these seams, and only these (each optional; `Method` does nothing by default):

    rescore(run, groups, examples, held_out)   rewards that need the policy itself, filled in
                                               after sampling (training, and held-out evaluation)
    prepare(run, plan, step) -> plan           before the update: the groups it trains on, its
                                               settings, its extra inputs (a reference model, a
                                               critic's credit, demonstrations, stored samples)
    after_update(run, plan, metrics, step)     after the update, before the weights reach the
                                               engine; returns metrics of its own
    metrics(run)                               metrics every step logs
    state_dict() / load_state_dict(state)      what a checkpoint keeps, under `state_key`
    task(task)                                 once at setup: the training data it leaves to RL

A method is built by its factory in METHODS from the run (its other parts are set up) and
`SetupInfo`; a factory returns None when the config does not ask for its method. The hooks run in
the order of METHODS.

A method whose update needs a part of its own on every learner rank (a reference model, a
critic, a teacher) builds it in a function of ``(cfg, policy, RankInfo) -> Extras | None`` in
ON_RANKS, and its factory builds its local part through that same function: data-parallel
learner ranks (rlvr.scaleout.learners) call `rank_extras`, and never name a method.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rlvr.data import Example
from rlvr.train.data import TaskData
from rlvr.train.update import Credit, LossTerm, UpdateSettings
from rlvr.types import Group

if TYPE_CHECKING:
    from rlvr.train.run import Run


@dataclass(frozen=True)
class Extras:
    """What an update takes beyond the groups and the settings (rlvr.train.update.update_policy's keywords)."""

    ref_model: PreTrainedModel | None = None
    credit: Credit | None = None
    """Per-token advantages in place of the outcome estimator (PPO's critic with GAE)."""
    loss_state: dict[str, float] | None = None
    terms: tuple[LossTerm, ...] = ()
    """Gradient terms of their own beside the policy loss (CHORD's SFT, DPH-RL's divergence)."""

    def keywords(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class Plan:
    """One step's update, as the methods prepared it."""

    groups: list[Group]
    """What the update trains on: this step's groups, then any replayed ones."""
    own: list[Group]
    """This step's groups as the policy sampled them: the sampler observes these, with the update's
    per-sample results (`UpdateResult.outcomes`)."""
    settings: UpdateSettings
    extras: Extras = field(default_factory=Extras)


@dataclass(frozen=True)
class SetupInfo:
    """What a method's factory may need beyond the run's parts."""

    device: torch.device
    dtype: torch.dtype
    """The learner's."""
    optimizer_steps: int
    """The learning-rate schedule's length."""
    resuming: bool
    quiet: bool


@dataclass(frozen=True)
class RankInfo:
    """What a learner rank's parts are built from, beside the config and the rank's policy."""

    optimizer_steps: int
    """The learning-rate schedule's length (a critic's optimizer follows it)."""
    tokenizer: Any
    fields_of: Callable[[Group], dict[str, Any]] | None = None
    """The fields of a group's example (what a function PRM reads: rlvr.train.methods.process)."""
    banned: bool = False
    """The engine never samples some tokens (a VLM's image placeholders): its distribution is truncated."""

    @classmethod
    def of(cls, run: Run, info: SetupInfo) -> RankInfo:
        """The local run's: what its methods' factories build their parts from."""
        from rlvr.data.images import image_token_ids
        from rlvr.train.methods.process import example_fields, fields_by_id

        return cls(info.optimizer_steps, run.tokenizer, example_fields(fields_by_id(run.task.examples)),
                   bool(image_token_ids(run.processor)))


class Method:
    """A method's seams (see the module docstring); every hook is a no-op here."""

    state_key: str | None = None
    """The checkpoint's key for this method's state (None: it keeps none)."""
    state_required = False
    """A checkpoint without this method's state cannot be resumed with it (else it starts fresh)."""

    def task(self, task: TaskData) -> TaskData:
        return task

    def rescore(self, run: Run, groups: list[Group], examples: list[Example], held_out: bool) -> list[Group]:
        return groups

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return plan

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        return {}

    def metrics(self, run: Run) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


# The methods' modules import the seams above, so they are imported here, below them.
from rlvr.train.methods import (distill, expert, intrinsic, kl, loss_state, ppo, process, rehearsal,  # noqa: E402
                                remax, rlp)

METHODS: dict[str, Callable[[Run, SetupInfo], Method | None]] = {
    "remax": remax.build,            # ReMax: a greedy completion per prompt as the baseline
    "kl": kl.build,                  # a reference model for the KL term; its coefficient, fixed or adaptive
    "loss_state": loss_state.build,  # what a stateful loss keeps across steps (R²VPO's λ)
    "ppo": ppo.build,                # PPO's learned critic and GAE (advantage = "gae")
    "distill": distill.build,        # on-policy distillation: a teacher's per-token reverse KL (advantage = "opd")
    "process": process.build,        # process supervision: a PRM's step scores as token advantages (advantage = "process")
    "rehearsal": rehearsal.build,    # DPH-RL: a divergence to the initial policy on its stored samples
    "luffy": expert.build_luffy,     # LUFFY: each group gets its prompt's demonstration
    "chord": expert.build_chord,     # CHORD: (1 − μ)·RL + μ·SFT on the step's demonstrations
    "intrinsic": intrinsic.build,    # rewards from the policy's own distributions (self-certainty, ...)
    "rlp": rlp.build,                # RLP: the information gain of a thought over an EMA baseline
    "relift": expert.build_relift,   # ReLIFT: SFT steps on the prompts RL keeps failing
}
"""Every method, by name; the order is the order their hooks run in."""


ON_RANKS: dict[str, Callable[[Any, PreTrainedModel, RankInfo], Extras | None]] = {
    "kl": kl.on_rank,            # the frozen reference model
    "ppo": ppo.on_rank,          # a replica of the critic (its state copied from the driver's before the first update)
    "distill": distill.on_rank,  # the frozen teacher
    "process": process.on_rank,  # the process reward model (and its critic)
}
"""What a method needs on every learner rank, by name: the same parts its factory builds locally."""


def rank_extras(cfg: Any, policy: PreTrainedModel, info: RankInfo) -> Extras:
    """The parts every method the config asks for needs on a learner rank, as one `Extras`
    (rlvr.scaleout.learners builds these on each rank; a new method is one entry in ON_RANKS)."""
    merged: dict[str, Any] = {}
    for name, build in ON_RANKS.items():
        extras = build(cfg, policy, info)
        if extras is None:
            continue
        for f in fields(Extras):
            value = getattr(extras, f.name)
            if value is None or (isinstance(value, tuple) and not value):
                continue
            if f.name in merged:
                raise ValueError(f"two methods each set the update's {f.name} (the second is {name}): "
                                 "their configs cannot be combined")
            merged[f.name] = value
    return Extras(**merged)


def build_methods(run: Run, info: SetupInfo) -> dict[str, Method]:
    """The methods the config asks for, by name, in METHODS order."""
    built = {name: factory(run, info) for name, factory in METHODS.items()}
    return {name: method for name, method in built.items() if method is not None}
