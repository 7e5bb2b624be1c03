"""Checking keyword arguments given by name (from a config) against the function they go to."""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Iterable
from typing import Any


def keyword_options(fn: Callable[..., Any]) -> list[str]:
    """Names of `fn`'s keyword-only parameters with defaults: the knobs a config may set
    (a keyword without a default, like ReMax's baseline_P, is an input the loop supplies)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty]


def check_keywords(what: str, fn: Callable[..., Any], keys: Iterable[str]) -> None:
    """Raise a ValueError naming the nearest valid keyword when `fn` does not take one of `keys`."""
    accepted = keyword_options(fn)
    for key in keys:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no keywords"
            raise ValueError(f"{what}: unknown keyword {key!r}{hint} ({takes})")
