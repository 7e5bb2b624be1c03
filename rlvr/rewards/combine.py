"""Resolve reward specs from the config and combine their scores into one scalar reward.

A config names each reward by a built-in name ("math_verify") or a dotted import path
("mypkg.rewards:score"), with a weight and keyword arguments. The total reward of a completion
is ``sum_i weight_i * fn_i(prompt, completion, **example, **kwargs_i)``. A reward function that
fails scores 0.0 for that completion instead of stopping the run; the failure is counted in
the returned per-function values and logged once per (reward, error type).
"""

from __future__ import annotations

import difflib
import importlib
import logging
import math
import numbers
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlvr.algos.registry import check_keywords
from rlvr.rewards.builtin import REWARDS
from rlvr.rewards.extract import EXTRACTORS

logger = logging.getLogger("rlvr.rewards")

_SPEC_KEYS = {"fn", "weight", "name", "kwargs"}
_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class RewardFn:
    """One resolved reward: its callable, weight in the total, and extra keyword arguments."""

    name: str
    fn: Callable[..., Any]
    weight: float
    kwargs: dict[str, Any]


def _split_path(spec: str) -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' → ('pkg.mod', 'fn'). The part after ':' may be dotted."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function'")
    return module, attr


def load_callable(spec: str) -> Callable[..., Any]:
    """The reward named by ``spec``: a key of REWARDS or a dotted path to a callable."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec and "." not in spec:
        nearest = difflib.get_close_matches(spec, REWARDS, n=1)
        hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
        raise ValueError(
            f"unknown reward {spec!r}.{hint} Built-in rewards: {', '.join(REWARDS)}; "
            "a user reward is a dotted path such as 'mypkg.rewards:score'"
        )
    module_name, attr_path = _split_path(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            public = [n for n in dir(obj) if not n.startswith("_")]
            nearest = difflib.get_close_matches(attr, public, n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ValueError(f"reward {spec!r}: {obj.__name__!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {attr_path!r} is a {type(obj).__name__}, not callable")
    return obj


def build_rewards(specs: list[dict[str, Any]]) -> list[RewardFn]:
    """Resolve config specs ``{"fn", "weight"=1.0, "name"=<last part of fn>, "kwargs"={}}``."""
    rewards: list[RewardFn] = []
    for i, spec in enumerate(specs):
        unknown = set(spec) - _SPEC_KEYS
        if unknown or "fn" not in spec:
            raise ValueError(
                f"reward spec #{i} {spec!r}: needs 'fn' and may have only {sorted(_SPEC_KEYS)}"
            )
        fn_spec = str(spec["fn"])
        name = spec.get("name") or fn_spec.replace(":", ".").rsplit(".", 1)[-1]
        weight = float(spec.get("weight", 1.0))
        if not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight must be finite, got {weight}")
        if any(r.name == name for r in rewards):
            raise ValueError(f"two rewards are named {name!r}; give one a distinct 'name'")
        fn, kwargs = load_callable(fn_spec), dict(spec.get("kwargs", {}))
        _check_kwargs(name, fn, kwargs)
        rewards.append(RewardFn(name, fn, weight, kwargs))
    return rewards


def _check_kwargs(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """A misspelt keyword or answer format is an error now, not a silent zero reward later."""
    if "extract" in kwargs and kwargs["extract"] not in EXTRACTORS:
        raise ValueError(f"reward {name!r}: extract={kwargs['extract']!r} is not an answer format; "
                         f"use one of {', '.join(EXTRACTORS)}")
    if fn not in REWARDS.values():
        return  # a user's function may take anything through **example
    check_keywords(f"reward {name!r}", fn, kwargs)


def _warn_once(name: str, kind: str, message: str) -> None:
    if (name, kind) not in _WARNED:
        _WARNED.add((name, kind))
        logger.warning(
            "reward %r failed (%s); scoring it 0.0. Further %s failures of this reward are "
            "counted in '%s/error' but not logged.\n%s",
            name, kind, kind, name, message,
        )


def _call(reward: RewardFn, prompt: str, completion: str, example: dict[str, Any]) -> float | None:
    """The reward's value as a finite float, or None (after a warning) if it failed."""
    try:
        # a data row's own "prompt" column (JSONL's default) is the prompt already passed
        fields = {k: v for k, v in example.items() if k not in ("prompt", "completion")}
        value = reward.fn(prompt, completion, **{**fields, **reward.kwargs})
    except Exception as exc:  # a user reward must not stop training; see module docstring
        summary = "".join(traceback.format_exception(exc, limit=-3))
        _warn_once(reward.name, type(exc).__name__, summary)
        return None
    if not isinstance(value, numbers.Real):  # bool is a Real: True → 1.0
        _warn_once(reward.name, "non-number", f"returned {type(value).__name__}: {value!r:.200}")
        return None
    if not math.isfinite(value):
        _warn_once(reward.name, "non-finite", f"returned {value!r}")
        return None
    return float(value)


def score(
    rewards: list[RewardFn], prompt: str, completion: str, example: dict[str, Any]
) -> tuple[float, dict[str, float]]:
    """The weighted total reward and each reward's raw value, keyed by name.

    A reward that raises or returns a non-finite or non-numeric value contributes 0.0, and the
    dict gains ``f"{name}/error": 1.0`` (the key is absent when the reward succeeded).
    """
    total = 0.0
    values: dict[str, float] = {}
    for reward in rewards:
        value = _call(reward, prompt, completion, example)
        if value is None:
            values[reward.name] = 0.0
            values[f"{reward.name}/error"] = 1.0
            continue
        values[reward.name] = value
        total += reward.weight * value
    return total, values
