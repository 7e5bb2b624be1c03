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
from dataclasses import fields
from typing import Any

from transformers import PreTrainedModel

from rlvr.train.methods import (distill, expert, intrinsic, kl, loss_state, ppo, process, rehearsal, remax,
                                rlp)
from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo, example_fields, fields_by_id
from rlvr.train.run import Run

__all__ = ["METHODS", "ON_RANKS", "Extras", "Method", "Plan", "RankInfo", "SetupInfo", "build_methods",
           "example_fields", "fields_by_id", "rank_extras"]

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
