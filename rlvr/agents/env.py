"""The environment protocol: an episode starts from an observation (the prompt) and advances one
action (the policy's text for a turn) at a time.

An environment is single-use: one instance per episode. One that holds something (a session on a
server) may have ``close()``, called once its episode has ended, however it ended. A group of G episodes of one prompt
takes G instances from the same factory, so each starts fresh (a stateful interpreter, a
puzzle's position) and none can leak into another. ``step`` may be ``async def``: the runner
then awaits the turn's steps of all episodes together, so slow tools overlap.

A single-turn task is the trivial environment: one step, done, rewarded by the task's verifier.

An environment may weight the KL term of the loss by turn: an attribute ``kl_turn_scale``, a
tuple of factors on ``algo.kl_coef`` for turn 0, 1, ... (the last for later turns), e.g.
self-correction's strong KL on the first attempt (rlvr.agents.self_correct).
"""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class StepResult:
    """What an environment returns for one action."""

    observation: str | None = None
    """Text shown to the policy before its next turn (a tool's output, feedback); None when done."""
    reward: float = 0.0
    """Reward for this turn; an episode's return is the sum over its turns."""
    done: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-turn numbers, summed over the episode and logged as env/<name> means (e.g. tool_calls,
    tool_errors). "void" = 1 marks a turn without a valid action; "excluded" = 1 an episode whose
    reward had no verdict (a reward that returned None or failed through no fault of the
    completion, rlvr.rewards.combine): its return is not a score, and the episode is excluded
    from the update (`no_verdict`); "masked" = 1 an episode kept out of the update whose verdict
    stands (rlvr.agents.runner._flags)."""


def timeout_seconds(value: Any) -> float:
    """`env.kwargs.timeout`, checked: a positive number of seconds."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ValueError(f"env.kwargs.timeout must be a positive number of seconds, got {value!r}")
    return float(value)


def no_verdict(parts: dict[str, float]) -> dict[str, float]:
    """``{"excluded": 1.0}`` when a completion's reward parts (rlvr.rewards.score) say a reward
    gave no verdict for it, else ``{}``: for an environment's final `StepResult` metrics."""
    return {"excluded": 1.0} if any(key.endswith("/excluded") for key in parts) else {}


class Env(Protocol):
    def initial_observation(self) -> str:
        """The first user message: the task."""
        ...

    def step(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Apply the policy's text for this turn."""
        ...
