"""The registry of training methods (see rlvr.train.methods): `METHODS` (each method's factory, in
hook order), `ON_RANKS` (what a method needs on every learner rank), and what a run composed
(`active`, `describe`, `composed`). Apart from the package's __init__, so that a module below
the methods (rlvr.train.run) can import the seams (rlvr.train.methods.base) without running
every method's module first."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

from transformers import PreTrainedModel

from rlvr.train.methods import (distill, expert, intrinsic, kl, loss_state, opponents, ppo, process, rehearsal,
                                remax, rlp, schedules)
from rlvr.config import RunConfig
from rlvr.train.methods.base import Extras, Method, RankInfo, SetupInfo
from rlvr.train.advantages import check_turn_credit
from rlvr.train.run import Run, rescores_in_training

__all__ = ["CHECKS", "METHODS", "ON_RANKS", "SEAMS", "active", "build_methods", "check", "composed", "describe",
           "rank_extras"]

METHODS: dict[str, Callable[[Run, SetupInfo], Method | None]] = {
    "schedules": schedules.build,    # staged generation lengths; shaping from a step on
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
    "warm_start": expert.build_warm_start,  # SFT epochs on the demonstrations once RL finds no signal
    "opponents": opponents.build,    # a game's opponent pool: the initial policy, then a snapshot every few steps
}
"""Every method, by name; the order is the order their hooks run in."""


ON_RANKS: dict[str, Callable[[Any, PreTrainedModel, RankInfo], Extras | None]] = {
    "kl": kl.on_rank,            # the frozen reference model
    "ppo": ppo.on_rank,          # a replica of the critic (its state copied from the driver's before the first update)
    "distill": distill.on_rank,  # the frozen teacher
    "process": process.on_rank,  # the process reward model (and its critic)
}
"""What a method needs on every learner rank, by name: the same parts its factory builds locally."""


CHECKS: dict[str, Callable[[RunConfig], None]] = {
    "kl": kl.check,                # a KL in the reward needs whole episodes
    "ppo": ppo.check,              # the critic: not with LoRA, nor with summarised episodes
    "remax": remax.check,          # the greedy baseline: not with asynchronous rollouts
    "expert": expert.check,        # LUFFY's loss and mode together; demonstrations are single-turn
    "intrinsic": intrinsic.check,  # rewards from the policy itself: not with asynchronous rollouts
    "rlp": rlp.check,              # the text source and the information_gain reward together
    "turn_credit": check_turn_credit,  # turn credit replaces the estimator, shaping and a KL in the reward
    "schedules": schedules.check,  # staged lengths: single-turn budgets
    "opponents": opponents.check,  # self-play's groups per role; earlier policies need the embedded engine
}
"""Each method's own check of a config, by name: what it cannot run beside. The config itself
compares no method's name (rlvr.config checks its sections alone)."""


def check(cfg: RunConfig) -> None:
    """Run every method's check of `cfg` (when a run opens, before anything is created or loaded);
    a ValueError says what to change."""
    for method_check in CHECKS.values():
        method_check(cfg)


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


SEAMS = ("task", "sampling", "rescore", "prepare", "after_update", "metrics", "save_after")
"""Method's hooks, in the order a run meets them."""


def active(methods: dict[str, Method], intrinsic: bool) -> dict[str, list[str]]:
    """The seams each method of a run plugs into: the hooks its class overrides, and "state" when
    a checkpoint keeps its state. A method's ``rescore`` runs in training only when a reward is
    intrinsic (``intrinsic``; rlvr.train.run.rescores_in_training), else on held-out groups alone, which the
    list says ("rescore (held-out only)") so a method that needs it can be seen not to run."""
    out = {}
    for name, method in methods.items():
        seams = [hook for hook in SEAMS if getattr(type(method), hook) is not getattr(Method, hook)]
        if "rescore" in seams and not intrinsic:
            seams[seams.index("rescore")] = "rescore (held-out only)"
        out[name] = seams + (["state"] if method.state_key is not None else [])
    return out


def describe(methods: dict[str, Method], intrinsic: bool) -> str:
    """One line: each active method and its seams (`active`), or "none" (the core step alone)."""
    seams = active(methods, intrinsic)
    return "; ".join(f"{name} ({', '.join(hooks) or 'built, no hooks'})" for name, hooks in seams.items()) or "none"


def composed(run: Run) -> str:
    """`describe` for a run: what it composed beside the core step, as its first metrics row and
    its config.toml header record it."""
    return describe(run.methods, rescores_in_training(run))
