"""The game protocol: several roles in one episode, each played by its own player (the policy, a
frozen opponent, a scripted one), each with its own return (rlvr.agents.games runs them).

A game is single-use, like an environment: one instance per episode, made from a start position
(an example's fields) by its class, ``Game(fields, **game_kwargs)``. It says whose move it is,
applies that role's action, and answers with what each role is told, what each role is paid, and
whether the game is over.

A game class also offers ``start(k, **game_kwargs)``, the fields of start position k (what
task.source = "env" makes the examples of), and ``scripted``, its scripted players by name: each
``(game, rng) -> action text``, a fixed opponent to train or measure against. It may offer
``forfeit(role)``, its verdict (a `GameStep`) on a role that the episode's limits stopped before
its move (its turns, sampled tokens or context): without it, such a game ends with no winner and
each role keeps what it was paid so far, which lets a role in a lost position escape its loss
by running out the clock.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass
class GameStep:
    """What a game answers to one action."""

    messages: dict[str, str] = field(default_factory=dict)
    """Text each role is told (by role): shown to it before its next move."""
    rewards: dict[str, float] = field(default_factory=dict)
    """What each role is paid for this move (by role; absent = 0); a role's return is the sum."""
    done: bool = False
    winner: str | None = None
    """When done: the role that won, or None (a draw, or a game without winners)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Numbers about the move, credited to the role that made it (summed over its moves and logged
    as env/<name> means: e.g. invalid, a move that forfeited)."""


class Game(Protocol):
    roles: tuple[str, ...]
    """The seats, in order (the first is the first to move in most games)."""
    scripted: dict[str, Callable[[Any, random.Random], str]]

    def opening(self, role: str) -> str:
        """The role's first message: the rules and the start as that role sees it."""
        ...

    def to_move(self) -> str:
        """The role whose move it is."""
        ...

    def step(self, action: str) -> GameStep:
        """Apply the moving role's action."""
        ...
