"""Prompt builders (``task.transforms``): each takes a task's examples and returns new ones, applied
in order after the source has made them and before the held-out ones are set apart.

    critique     "Problem / Proposed answer": the policy judges it (rlvr.data.critique)
    budget       "Answer in about N tokens." (rlvr.data.control)
    think_mode   "/think" or "/no_think" (rlvr.data.control)

Your own: ``fn = "pkg.module:function"``, called as ``function(examples, *, seed, **kwargs)``.
A builder whose attribute ``shows_problem_only`` is true gets the source's prompts without the
task's default instruction to answer (a critique shows the problem, not the request to solve it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlvr.data.control import budget_examples, think_mode_examples
from rlvr.data.critique import critique_examples
from rlvr.data.tasks import Example
from rlvr.rewards.combine import load_callable

TRANSFORMS: dict[str, Callable[..., list[Example]]] = {"critique": critique_examples, "budget": budget_examples,
                                                       "think_mode": think_mode_examples}


def transform(name: str) -> Callable[..., list[Example]]:
    """A registered builder, or ``pkg.module:function``."""
    if name in TRANSFORMS:
        return TRANSFORMS[name]
    if ":" in name:
        return load_callable(name)
    raise ValueError(f"task.transforms: unknown fn {name!r}; choose from {', '.join(TRANSFORMS)} or give "
                     "pkg.module:function")


def shows_problem_only(specs: list[Any]) -> bool:
    """Whether a builder of ``specs`` wants the source's prompts without the default instruction."""
    return any(getattr(transform(spec.fn), "shows_problem_only", False) for spec in specs)
