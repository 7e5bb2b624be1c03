"""Prompts that ask for a length or a mode: budget-conditioned tasks and think / no-think tasks.

The builder ``budget`` (``task.transforms = [{fn = "budget", kwargs = {budgets = [16, 64]}}]``)
appends a token budget to each prompt ("Answer in about 64 tokens.") drawn for the example from
``budgets``, and keeps it as the field ``budget``, which the ``budget`` reward scores the
completion's length against (L1's length-controlled policy optimisation: Aggarwal and Welleck,
"L1: Controlling How Long A Reasoning Model Thinks With Reinforcement Learning",
arXiv:2503.04697).

The builder ``think_mode`` (``kwargs = {no_think_fraction = 0.5}``) appends a mode switch to each
prompt (Qwen3's soft switches, "/think" and "/no_think", by default) and keeps it as the field
``mode``, which the ``think_mode`` reward checks the completion follows: a reasoning block when
asked to think, none (or an empty one) when not.
"""

from __future__ import annotations

import random
from typing import Any

from rlvr.data.tasks import Example
from rlvr.rewards.styles import PROMPT_MESSAGES

BUDGET_TEMPLATE = "Answer in about {budget} tokens."


def budget_examples(pool: list[Example], *, seed: int, budgets: list[int],
                    template: str = BUDGET_TEMPLATE) -> list[Example]:
    """Each example with a budget from ``budgets`` (drawn per example, seeded) in its prompt and
    its field ``budget``."""
    if not budgets or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in budgets):
        raise ValueError(f"task.transforms budget: budgets must be a non-empty list of positive token counts, got {budgets!r}")
    if "{budget}" not in template:
        raise ValueError(f"task.transforms budget: template {template!r} has no {{budget}}")
    rng = random.Random(seed)
    out = []
    for ex in pool:
        budget = rng.choice(budgets)
        out.append(_appended(ex, template.format(budget=budget), {"budget": budget}))
    return out


def think_mode_examples(pool: list[Example], *, seed: int, no_think_fraction: float = 0.5, think: str = "/think",
                        no_think: str = "/no_think") -> list[Example]:
    """Each example with a mode switch appended (``no_think`` with probability
    ``no_think_fraction``, else ``think``) and its field ``mode`` ("think" or "no_think")."""
    if not 0.0 <= no_think_fraction <= 1.0:
        raise ValueError(f"task.transforms think_mode: no_think_fraction must be between 0 and 1, got {no_think_fraction}")
    rng = random.Random(seed + 1)
    out = []
    for ex in pool:
        mode = "no_think" if rng.random() < no_think_fraction else "think"
        out.append(_appended(ex, no_think if mode == "no_think" else think, {"mode": mode}))
    return out


def _appended(ex: Example, text: str, fields: dict[str, Any]) -> Example:
    """``ex`` with ``text`` after its prompt (and after its last user message, for a conversation)."""
    messages = ex.fields.get(PROMPT_MESSAGES)
    own = dict(ex.fields)
    if messages is not None:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise ValueError(f"{ex.id}: a conversation without a user message has nowhere to ask for a length or mode")
        last = users[-1]
        own[PROMPT_MESSAGES] = [*messages[:last], {**messages[last], "content": f"{messages[last]['content']} {text}"},
                                *messages[last + 1:]]
    return Example(f"{ex.prompt} {text}" if ex.prompt else text, ex.answer, {**own, **fields}, ex.id)
