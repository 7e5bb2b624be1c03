"""Checking keyword arguments given by name (from a config) against the function they go to."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from rlvr.options import check_names, check_present, options, within  # noqa: F401  (re-exported: the registries' checks)


def keyword_options(fn: Callable[..., Any], required: bool = False) -> list[str]:
    """Names of `fn`'s keyword-only parameters with defaults: the knobs a config may set (a loss's
    or a correction's inputs arrive positionally, as one rlvr.algos.inputs.LossInputs).
    `required`: those without a default too (for a function whose every keyword is a knob, e.g. an
    advantage estimator; a reward's keywords without defaults are the row's fields)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and (required or p.default is not inspect.Parameter.empty)]


def check_keywords(what: str, fn: Callable[..., Any], keys: Iterable[str],
                   accepted: list[str] | None = None, required: bool = False) -> None:
    """Raise a ValueError naming the nearest valid keyword when `fn` does not take one of `keys`
    (`accepted`: the names it takes; default: its keyword options). `required`: every keyword of
    `fn` is a knob, and one without a default missing from `keys` is an error too."""
    keys = list(keys)
    if accepted is None:
        accepted = keyword_options(fn, required)
        check_present(what, [k for k in accepted if k not in keyword_options(fn)], keys, accepted)
    check_names(what, keys, accepted)


