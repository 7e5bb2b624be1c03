"""Rewards for following a requested length or mode (rlvr.data.control makes the prompts).

``budget``: how far the completion's length (its sampled tokens) is from the example's
``budget``, as a penalty that is 0 on target; add it to a correctness reward, as L1's LCPO does
(Aggarwal and Welleck, arXiv:2503.04697: r = 1[correct] − α·|n_budget − n|):

    mode = "exact":  −α·|n − budget|            (LCPO-Exact's length term)
    mode = "max":    −α·max(0, n − budget)      (only a completion over the budget pays)

α is ``alpha`` per token, by default 1/budget (a relative deviation, so short and long budgets
weigh alike), and the penalty stops at ``floor`` (−1), so that one runaway completion does not
outweigh its correctness many times over.

``think_mode``: 1 when the completion follows the example's ``mode``: "think" asks for a reasoning
block (``open`` … ``close``, "<think>" … "</think>") with something in it, "no_think" for none, or
an empty one (as Qwen3 writes when not thinking); else 0.
"""

from __future__ import annotations

import re
from typing import Any


def budget_reward(prompt: str, completions: list[str], *, budget: int, completion_ids: list[Any] | None = None,
                  mode: str = "exact", alpha: float | None = None, floor: float = -1.0, **_: Any) -> list[float]:
    """The length penalty of each completion of a group (see the module docstring)."""
    if mode not in ("exact", "max"):
        raise ValueError(f"budget reward: mode must be \"exact\" or \"max\", got {mode!r}")
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise ValueError(f"budget reward: the example's budget must be a positive token count, got {budget!r} "
                         "(task.transforms' fn = \"budget\" sets it)")
    if completion_ids is None or len(completion_ids) != len(completions):
        raise ValueError("budget reward: needs each completion's token ids (single-turn tasks; an episode's length "
                         "is not one completion's)")
    per_token = 1.0 / budget if alpha is None else float(alpha)
    out = []
    for ids in completion_ids:
        over = len(ids) - budget
        distance = abs(over) if mode == "exact" else max(0, over)
        out.append(max(floor, -per_token * distance))
    return out


budget_reward.wants_completion_ids = True  # type: ignore[attr-defined]


def think_mode_reward(prompt: str, completion: str, *, mode: str, open: str = "<think>",  # noqa: A002
                      close: str = "</think>", **_: Any) -> float:
    """1 when the completion thinks exactly when asked to (see the module docstring), else 0."""
    if mode not in ("think", "no_think"):
        raise ValueError(f"think_mode reward: the example's mode must be \"think\" or \"no_think\", got {mode!r} "
                         "(task.transforms' fn = \"think_mode\" sets it)")
    blocks = re.findall(re.escape(open) + r"(.*?)" + re.escape(close), completion, flags=re.S)
    unclosed = completion.count(open) > len(blocks)
    thought = any(b.strip() for b in blocks) or unclosed
    if mode == "think":
        return float(thought and not unclosed)
    return float(not thought)
