"""OpenEnv environments for configs/openenv_sums.toml and the tests, written with OpenEnv's own
server package (`pip install openenv`) as its docs lay an environment out: an Action, an
Observation and a State model, an Environment subclass, and `create_fastapi_app`. Served by uvicorn:

    python -m uvicorn rlvr.configs.openenv_server:sums --port 8000    # one-digit sums (one step)
    python -m uvicorn rlvr.configs.openenv_server:guess --port 8000   # guess a number (multi-turn)
    python -m uvicorn rlvr.configs.openenv_server:shaped --port 8000  # sums, with a spread for the tests
"""

from __future__ import annotations

import functools
import random
import re
import time
import uuid
from typing import Any

from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class TextAction(Action):
    message: str


class GuessObservation(Observation):
    prompt: str = ""
    feedback: str = ""
    attempts_left: int = 0


class GuessState(State):
    secret: int = 0


class GuessEnvironment(Environment[TextAction, GuessObservation, GuessState]):
    """Find a number from 1 to 20 (drawn from the reset's seed) in 5 guesses, told "higher" or
    "lower"; reward 1 for the right one. "crash" raises; "slow" takes 3 s."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    TRIES = 5

    def __init__(self) -> None:
        super().__init__()
        self._state = GuessState()

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> GuessObservation:
        secret = random.Random(seed).randint(1, 20)
        self._state = GuessState(episode_id=episode_id or str(uuid.uuid4()), step_count=0, secret=secret)
        return GuessObservation(prompt="I am thinking of a number from 1 to 20. Guess it: reply with one number.",
                                attempts_left=self.TRIES)

    def step(self, action: TextAction, timeout_s: float | None = None, **kwargs: Any) -> GuessObservation:
        if action.message == "crash":
            raise RuntimeError("the environment broke")
        if action.message == "slow":
            time.sleep(3)
        self._state.step_count += 1
        left = self.TRIES - self._state.step_count
        found = re.search(r"-?\d+", action.message)
        if found is None:
            return GuessObservation(feedback="Reply with one number.", attempts_left=left, reward=0.0, done=left <= 0)
        guess = int(found.group())
        if guess == self._state.secret:
            return GuessObservation(feedback="Correct!", attempts_left=left, reward=1.0, done=True)
        hint = "higher" if guess < self._state.secret else "lower"
        return GuessObservation(feedback=f"{guess} is wrong: the number is {hint}.", attempts_left=left, reward=0.0,
                                done=left <= 0)

    @property
    def state(self) -> GuessState:
        return self._state


class SumAction(Action):
    message: str
    seed: int | None = None
    """The reset's seed, for a step on OpenEnv's stateless HTTP routes (a new environment for every
    request), which learns the question from it (rlvr: env.kwargs.step_fields = ["seed"])."""


class SumObservation(Observation):
    prompt: str = ""


def question(seed: int | None) -> tuple[int, int]:
    rng = random.Random(seed)
    return rng.randint(0, 9), rng.randint(0, 9)


class SumEnvironment(Environment[SumAction, SumObservation, State]):
    """One step: "What is a + b?", a and b from 0 to 9 drawn from the reset's seed; reward 1 when
    the reply's last number is the sum, else 0. ``shaped`` (for the tests): else the share of
    distinct characters (up to 10) / 20, a spread among the tiny model's random samples for an
    update to move (a reward a policy could farm: not for real training)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, shaped: bool = False) -> None:
        super().__init__()
        self.shaped = shaped
        self.seed: int | None = None

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> SumObservation:
        self.seed = seed
        a, b = question(seed)
        return SumObservation(prompt=f"What is {a} + {b}? Answer with just the number.")

    def step(self, action: SumAction, timeout_s: float | None = None, **kwargs: Any) -> SumObservation:
        a, b = question(action.seed if action.seed is not None else self.seed)
        numbers = re.findall(r"-?\d+", action.message)
        if numbers and int(numbers[-1]) == a + b:
            return SumObservation(reward=1.0, done=True)
        return SumObservation(reward=min(len(set(action.message)), 10) / 20 if self.shaped else 0.0, done=True)

    @property
    def state(self) -> State:
        return State()


guess = create_fastapi_app(GuessEnvironment, TextAction, GuessObservation, max_concurrent_envs=256)
sums = create_fastapi_app(SumEnvironment, SumAction, SumObservation, max_concurrent_envs=256)
shaped = create_fastapi_app(functools.partial(SumEnvironment, shaped=True), SumAction, SumObservation,
                            max_concurrent_envs=256)
