"""Checking keyword arguments given by name (from a config) against the function they go to."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

from rlvr.options import check_names, check_present, options, within  # noqa: F401  (re-exported: the registries' checks)


LOOP_INPUTS: dict[str, str] = {
    "correct_BT": "1 on every token of a sample whose first (correctness) reward gave full marks (NFT)",
    "group_accuracy_BT": "the share of correct samples in the sample's group, on every token (NFT)",
    "offpolicy_BT": "1 on the tokens of an expert demonstration mixed into its group (LUFFY)",
    "loss_state": "a dict the loss keeps across steps, saved in checkpoints (R²VPO's dual variable)",
    "advantages_BT": "the per-token advantages (an off-policy correction's input: OPSM)",
    "logprobs_BT": "the policy's log-probs of the sampled tokens in this pass, detached (OPSM)",
    "old_logprobs_BT": "the log-probs the PPO ratio is taken against (π_old), detached (the ratio-weighted KL)",
}
"""Keywords of the policy losses, off-policy corrections and KL estimators that the training loop fills in,
never a config setting (a loss takes log-probs and advantages positionally).
(An advantage estimator's inputs beyond the rewards arrive as one record instead:
rlvr.algos.advantages.AdvantageInputs.)"""


def keyword_options(fn: Callable[..., Any], required: bool = False) -> list[str]:
    """Names of `fn`'s keyword-only parameters with defaults: the knobs a config may set (one named
    in LOOP_INPUTS is an input the loop supplies). `required`: those without a default too (for a
    function whose every keyword is a knob, e.g. an advantage estimator; a reward's keywords
    without defaults are the row's fields)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in LOOP_INPUTS
            and (required or p.default is not inspect.Parameter.empty)]


def loop_inputs(fn: Callable[..., Any]) -> list[str]:
    """The LOOP_INPUTS that `fn` takes as keywords (a positional argument of the same name, such as
    a loss's own ``old_logprobs_BT``, is the caller's to pass)."""
    return [p.name for p in inspect.signature(fn).parameters.values()
            if p.name in LOOP_INPUTS and p.kind is inspect.Parameter.KEYWORD_ONLY]


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


