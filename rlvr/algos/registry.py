"""Checking keyword arguments given by name (from a config) against the function they go to."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any


LOOP_INPUTS: dict[str, str] = {
    "baseline_P": "the reward of each prompt's greedy completion (ReMax; Group.greedy_reward)",
    "strata_PG": "each sample's stratum id (SAN; the reward part named by algo.stratum_key)",
    "pool_mean_P": "mean reward over every response generated for the prompt (Group.pool_rewards)",
    "pool_std_P": "std of the same pool (unbiased)",
    "reward_parts_KPG": "each reward function's raw value, stacked by reward name (BNPO decomposition)",
    "values_BT": "the critic's value of each completion token (GAE)",
    "correct_BT": "1 on every token of a sample whose first (correctness) reward gave full marks (NFT)",
    "group_accuracy_BT": "the share of correct samples in the sample's group, on every token (NFT)",
    "offpolicy_BT": "1 on the tokens of an expert demonstration mixed into its group (LUFFY)",
    "loss_state": "a dict the loss keeps across steps, saved in checkpoints (R²VPO's dual variable)",
}
"""Keywords of the algorithm functions that the training loop fills in, never a config setting."""


def keyword_options(fn: Callable[..., Any]) -> list[str]:
    """Names of `fn`'s keyword-only parameters with defaults: the knobs a config may set
    (a keyword without a default, or one named in LOOP_INPUTS, is an input the loop supplies)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty
            and p.name not in LOOP_INPUTS]


def loop_inputs(fn: Callable[..., Any]) -> list[str]:
    """The LOOP_INPUTS that `fn` takes."""
    return [name for name in inspect.signature(fn).parameters if name in LOOP_INPUTS]


def check_keywords(what: str, fn: Callable[..., Any], keys: Iterable[str],
                   accepted: list[str] | None = None) -> None:
    """Raise a ValueError naming the nearest valid keyword when `fn` does not take one of `keys`
    (`accepted`: the names it takes; default: its keyword options)."""
    accepted = keyword_options(fn) if accepted is None else accepted
    for key in keys:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no keywords"
            raise ValueError(f"{what}: unknown keyword {key!r}{hint} ({takes})")


def options(what: str, cls: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, a method's options from a config's kwargs: each name checked against `cls`'s
    parameters (the nearest named when unknown), each value by `cls` itself."""
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    check_keywords(what, cls, kwargs, [p.name for p in inspect.signature(cls).parameters.values() if p.kind in named])
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: {err}") from None


def within(name: str, value: float, low: float, high: float | None = None) -> None:
    """Raise a ValueError unless low <= value (<= high)."""
    if not (low <= value and (high is None or value <= high)):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound} (got {value!r})")
