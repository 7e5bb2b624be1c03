"""An environment whose server answers 5xx or closes the connection: the episode ends without a
verdict, counted in env/error and excluded from the update; the other episodes of the batch go on.
And an agent that rewrites its history: every segment it sent is trained as sampled, and the
episode says how many there were (env/segments)."""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.agents.env import StepResult
from rlvr.agents.runner import FAILED, Limits
from tests.test_agents import Counter, setup

pytestmark = pytest.mark.dtype_independent  # what these faults end in does not depend on "auto" precision


class _Flaky(http.server.BaseHTTPRequestHandler):
    """Answers "/500" with HTTP 500, closes "/close" without a word, and "/ok" with a reward."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/close":
            self.close_connection = True
            self.wfile.flush()
            self.connection.shutdown(2)
            return
        body = json.dumps({"reward": 1.0, "done": True}).encode()
        self.send_response(500 if self.path == "/500" else 200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def env_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Flaky)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class RemoteEnv(Counter):
    """An environment whose step is a call to its server (as OpenEnv's and Harbor's are)."""

    def __init__(self, url: str) -> None:
        super().__init__(1)
        self.url = url

    def step(self, action: str) -> StepResult:
        request = urllib.request.Request(self.url, data=json.dumps({"action": action}).encode(), method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            answer = json.loads(response.read())
        return StepResult(None, reward=answer["reward"], done=answer["done"])


def test_an_environment_server_that_fails_ends_its_episode_without_a_verdict(
        env_server: str, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    envs = [RemoteEnv(f"{env_server}/500"), RemoteEnv(f"{env_server}/close"), RemoteEnv(f"{env_server}/ok")]
    episodes, _ = setup(tiny_model, tiny_tokenizer, envs, Limits(max_turns=2))
    assert [e.ending for e in episodes] == ["infra", "infra", "done"]
    assert [e.reward for e in episodes] == [0.0, 0.0, 1.0]  # the failed ones are excluded, not trained at 0
    assert all(e.ending in FAILED for e in episodes[:2])  # counted in env/error, excluded (rlvr.agents.runner)


def test_an_agent_that_rewrites_its_history_trains_what_was_sampled_and_says_so() -> None:
    """Each call whose prompt does not extend the one before opens a segment of its own, trained
    on the ids the engine sampled; env/segments counts them (none said so before)."""
    import openai

    from tests.test_openai_agent import run

    async def rewrites(client: openai.AsyncOpenAI, row: dict[str, Any]) -> None:
        messages: list[Any] = [{"role": "user", "content": row["prompt"]}]
        first = await client.chat.completions.create(model="m", messages=messages)
        messages += [{"role": "assistant", "content": "an answer it never gave"}, {"role": "user", "content": "go on"}]
        await client.chat.completions.create(model="m", messages=messages)
        assert first.choices

    from rlvr.agents.runner import episode_metrics

    groups = run(rewrites, n=1)
    assert all(len(s.segments) == 1 for g in groups for s in g.samples)  # one earlier segment beside the last
    assert episode_metrics(groups)["env/segments"] == 2.0
