"""`rlvr serve` losing a client mid-request: its slot is free at once (tests/test_serve.py), and
now the engine stops sampling for nobody at its next decode step, where it ran a whole max_tokens
with the next request waiting behind it (6.5 s in a review, session 22)."""

from __future__ import annotations

import threading
import time
from typing import Any

import openai
import pytest

import rlvr.rollout.static_decode as static_decode
from rlvr.serve.app import Served
from rlvr.serve.protocol import Limits
from rlvr.serve.server import BackgroundServer
from tests.test_serve import tiny_served

pytestmark = pytest.mark.dtype_independent  # what these faults end in does not depend on "auto" precision


def test_a_client_that_leaves_mid_generation_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    steps = {"n": 0}
    real = static_decode.StaticDecoder.step

    def slow_step(self: Any, *args: Any) -> Any:  # 20 ms a token: 1,000 tokens take 20 s
        steps["n"] += 1
        time.sleep(0.02)
        return real(self, *args)

    monkeypatch.setattr(static_decode.StaticDecoder, "step", slow_step)
    served = tiny_served()
    served = Served(served.name, served.tokenizer, served.engine, served.model, context_length=2048)
    with BackgroundServer(served, limits=Limits(max_concurrent=1, max_tokens=1000)) as s:
        quitter = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=0.5)
        patient = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)

        def give_up() -> None:
            with pytest.raises(openai.APITimeoutError):
                quitter.completions.create(model="tiny", prompt="a long story", max_tokens=1000, stream=True)

        leaving = threading.Thread(target=give_up)
        leaving.start()
        leaving.join()
        time.sleep(0.5)  # the server hears of it when the connection closes; the engine stops at its next step
        start = time.perf_counter()
        answer = patient.completions.create(model="tiny", prompt="next", max_tokens=2)
        waited = time.perf_counter() - start
    assert answer.choices and waited < 3, waited  # not behind the rest of the 1,000 tokens
    assert steps["n"] < 200, steps  # the abandoned call stopped early (~50 steps in its second)
