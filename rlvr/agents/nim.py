"""Nim, the two-player game the bundled model learns to play (`env.name = "game"`, rlvr.agents.games).

A pile of stones; the players take turns, each taking 1 to ``take`` stones; whoever takes the last
stone wins. A reply is read for its last whole number (digits, or a word up to ten); one that is not a legal
take (no number, too many, too few) forfeits the game. The winner's return is +1, the loser's −1.

The game is solved (Bouton, "Nim, a game with a complete mathematical theory", Annals of
Mathematics 3(1/4), 1901; this one-pile form is the subtraction game): the player to move wins
exactly when the pile is not a multiple of ``take + 1``, by leaving one. The scripted player
``optimal`` plays so (a random legal take where it cannot win); ``random`` takes a uniformly
random legal number. Against ``random`` a player that only knows to take the whole pile once it
can (1 to ``take`` stones left) already wins far more than half of its games; against
``optimal`` nothing wins a position that is lost.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from typing import Any

from rlvr.agents.game import GameStep

WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}
_NUMBER = re.compile(r"-?\d+|\b(?:" + "|".join(WORDS) + r")\b", re.IGNORECASE)


def taken(action: str) -> int | None:
    """The number a reply takes: its last whole number, in digits or as a word up to ten ("I take
    three"), or None."""
    found = _NUMBER.findall(action)
    if not found:
        return None
    last = found[-1].lower()
    if last in WORDS:
        return WORDS[last]
    return int(last) if len(last) <= 9 else None  # a number that long takes nothing legal (and int() may refuse it)


def _random(game: Nim, rng: random.Random) -> str:
    return str(rng.choice(game.legal()))


def _optimal(game: Nim, rng: random.Random) -> str:
    winning = game.left % (game.take + 1)
    return str(winning) if winning else _random(game, rng)


class Nim:
    """One game of Nim from a start position (``fields["stones"]``, from `start`)."""

    roles = ("first", "second")
    scripted: dict[str, Callable[[Any, random.Random], str]] = {"random": _random, "optimal": _optimal}
    """Scripted players, by name (`env.kwargs.opponent`)."""

    def __init__(self, fields: dict[str, Any], *, low: int = 5, high: int = 15, take: int = 3) -> None:
        _check(low, high, take)
        stones = fields.get("stones")
        if isinstance(stones, bool) or not isinstance(stones, int) or stones < 1:
            raise ValueError(f"nim: the start position needs a whole number of stones >= 1, got {stones!r}")
        self.left, self.take, self.mover = stones, take, 0
        self.stones = stones

    @classmethod
    def start(cls, k: int, *, low: int = 5, high: int = 15, take: int = 3) -> dict[str, Any]:
        """Start position `k`: a pile drawn from [low, high] by k alone."""
        _check(low, high, take)
        return {"stones": random.Random(f"nim/{k}").randint(low, high)}

    def _options(self) -> str:
        top = min(self.take, self.left)
        return "1" if top == 1 else f"1 to {top}"

    def opening(self, role: str) -> str:
        rules = (f"We play Nim. There are {self.stones} stones. We take turns; each turn a player takes 1 to "
                 f"{self.take} stones. Whoever takes the last stone wins. Reply with just the number of stones you "
                 "take.")
        return (f"{rules}\nYou move first: how many stones do you take?" if role == "first"
                else f"{rules}\nYour opponent moves first.")

    def to_move(self) -> str:
        return self.roles[self.mover]

    def legal(self) -> list[int]:
        return list(range(1, min(self.take, self.left) + 1))

    def step(self, action: str) -> GameStep:
        me, other = self.roles[self.mover], self.roles[1 - self.mover]
        number = taken(action)
        if number not in self.legal():
            return GameStep(rewards={me: -1.0, other: 1.0}, done=True, winner=other,
                            metrics={"invalid": 1.0, "moves": 1.0})
        assert number is not None
        self.left -= number
        if self.left == 0:
            return GameStep(rewards={me: 1.0, other: -1.0}, done=True, winner=me, metrics={"moves": 1.0})
        self.mover = 1 - self.mover
        stones = "stone is" if self.left == 1 else "stones are"
        return GameStep(messages={other: f"Your opponent took {number}. {self.left} {stones} left. How many stones "
                                         f"do you take ({self._options()})?"}, metrics={"moves": 1.0})

    def forfeit(self, role: str) -> GameStep:
        """A role the episode's limits stopped before its move loses, as for an illegal move."""
        other = self.roles[1 - self.roles.index(role)]
        return GameStep(rewards={role: -1.0, other: 1.0}, done=True, winner=other)


def _check(low: Any, high: Any, take: Any) -> None:
    for name, value in (("low", low), ("high", high), ("take", take)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"nim: env.kwargs.game_kwargs.{name} must be a whole number >= 1, got {value!r}")
    if low > high:
        raise ValueError(f"nim: game_kwargs.low ({low}) is above high ({high})")
    if low <= take:
        raise ValueError(f"nim: game_kwargs.low ({low}) must be above take ({take}): else the first player can take "
                         "the whole pile before the second ever moves")
