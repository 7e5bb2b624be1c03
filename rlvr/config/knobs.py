"""Every knob a config can reach (`rlvr config --all`): the declared keys, and under each open
table (``algo.loss_kwargs``, ``sampler.rollouts_kwargs``, ``dist.ray``, ...) the keys it takes
for every choice it can follow, with their defaults, read from the function or options class
that receives them. Importing the registries imports torch: this is the slow listing, and
`rlvr config` without ``--all`` stays the fast one (rlvr.config.files.describe)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from rlvr.config.files import declared_keys, describe


def _knobs(target: Callable[..., Any], every_keyword: bool = False) -> list[tuple[str, Any]]:
    """(name, default) of what `target` takes by name from a config: an options class's fields,
    or a function's keyword-only parameters (``every_keyword``: those without a default too)."""
    if dataclasses.is_dataclass(target):
        return [(f.name, f.default if f.default is not dataclasses.MISSING else
                 f.default_factory() if f.default_factory is not dataclasses.MISSING else "(required)")
                for f in dataclasses.fields(target)]
    # a class (a sampler, a tracker) takes its knobs by name in any form; a function, keyword-only
    kinds = ((inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD) if inspect.isclass(target)
             else (inspect.Parameter.KEYWORD_ONLY,))
    out = []
    for p in inspect.signature(target).parameters.values():
        if p.kind not in kinds or p.name in ("self", "ctx"):
            continue
        if p.default is inspect.Parameter.empty and not every_keyword:
            continue
        out.append((p.name, "(required)" if p.default is inspect.Parameter.empty else p.default))
    return out


def open_tables() -> Iterator[tuple[str, str, Callable[..., Any], bool]]:
    """(config key, choice, what receives the table's keys for that choice, every keyword a knob)."""
    from rlvr.algos import CORRECTIONS, ESTIMATORS, LOSSES, PER_TOKEN, SHAPING
    from rlvr.algos.entropy_control import EntropyOptions
    from rlvr.algos.kl import AdaptiveKL
    from rlvr.data.curricula import CURRICULA
    from rlvr.log.tracking import TRACKERS
    from rlvr.options import (EXPERT_OPTIONS, ROLLOUT_OPTIONS, AsyncOptions, RayOptions, RehearsalOptions,
                              ReplayOptions, Summarize)
    from rlvr.rewards.builtin import REWARDS
    from rlvr.sandbox import Limits

    # (key, the setting that chooses among the registry's entries, or "" for a table of one
    # receiver, the registry, every keyword a knob), in the config's order
    tables: list[tuple[str, str, dict[str, Any], bool]] = [
        ("algo.advantage_kwargs", "advantage", ESTIMATORS, True),
        ("algo.advantage_kwargs", "advantage", PER_TOKEN, False),
        ("algo.loss_kwargs", "loss", LOSSES, False),
        ("algo.offpolicy_kwargs", "offpolicy", CORRECTIONS, True),
        ("algo.shaping.kwargs", "fn", SHAPING, False),
        ("algo.entropy", "", {"": EntropyOptions}, False),
        ("algo.kl_adaptive", "", {"": AdaptiveKL}, False),
        ("algo.divergence_kwargs", "", {"": RehearsalOptions}, False),
        ("rewards.kwargs", "fn", REWARDS, False),
        ("sampler.kwargs", "name", CURRICULA, False),
        ("sampler.rollouts_kwargs", "rollouts", ROLLOUT_OPTIONS, False),
        ("sampler.replay", "", {"": ReplayOptions}, False),
        ("expert.kwargs", "mode", EXPERT_OPTIONS, False),
        ("env.summarize", "", {"": Summarize}, False),
        ("sandbox.limits", "", {"": Limits}, False),
        ("dist.ray", "", {"": RayOptions}, False),
        ("dist.async_rollouts", "", {"": AsyncOptions}, False),
        *((f"log.sink_kwargs.{name}", "", {"": tracker}, False) for name, tracker in TRACKERS.items()),
    ]
    for key, setting, registry, every in tables:
        for name, target in registry.items():
            yield key, f'{setting} = "{name}"' if setting else "", target, every


def describe_all(command: str = "train") -> str:
    """`describe(command)`, then every open table's keys by choice, and the count of both."""
    lines = [describe(command), "", f"# the keys of `rlvr {command}`'s open tables, for each choice they follow"]
    declared = declared_keys(command)
    reachable = 0
    tables = set()
    for key, choice, target, every in open_tables():
        head = "rewards" if key == "rewards.kwargs" else ".".join(key.split(".")[:2])
        if not any(d == head or d.startswith(head + ".") for d in declared):
            continue  # a table this command does not read
        tables.add(key)
        knobs = _knobs(target, every)
        reachable += len(knobs)
        shown = ", ".join(f"{name} = {default!r}" for name, default in knobs) or "(none)"
        lines.append(f"{key}{f'  [{choice}]' if choice else ''}: {shown}")
    lines.append(f"\n# {len(declared)} declared keys; {len(tables)} open tables reach {reachable} more "
                 f"(counted once per choice they follow; engine.vllm_kwargs, env.kwargs and a reward's own "
                 f"function take what vLLM, the environment and your function take, not counted)")
    return "\n".join(lines)
