"""OpenEnv environments (env.name = "openenv") against servers built with OpenEnv's own package
(rlvr/configs/openenv_server.py), over its WebSocket and its HTTP routes: exact token bookkeeping,
seeds shared by a group, and every way a server fails ending the episode "infra", never the
policy's failure."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openenv.core.env_server.http_server")

from rlvr.agents import Limits  # noqa: E402
from rlvr.agents.envs import env_factory  # noqa: E402
from rlvr.agents.openenv_env import check, examples  # noqa: E402
from rlvr.agents.runner import ChatDelta, episode_groups  # noqa: E402
from rlvr.serve.server import ThreadedApp  # noqa: E402
from rlvr.types import Completion, SamplingParams  # noqa: E402
from tests.tiny import EOS_ID, make_tiny_tokenizer  # noqa: E402

pytestmark = pytest.mark.dtype_independent  # scripted policies: no model


@pytest.fixture(scope="module")
def guess_url() -> Iterator[str]:
    from rlvr.configs.openenv_server import guess

    server = ThreadedApp(guess, name="openenv-guess")
    yield f"http://127.0.0.1:{server.port}"
    server.close()


@pytest.fixture(scope="module")
def sums_url() -> Iterator[str]:
    from rlvr.configs.openenv_server import shaped

    server = ThreadedApp(shaped, name="openenv-sums")
    yield f"http://127.0.0.1:{server.port}"
    server.close()


class Scripted:
    """An engine whose every action is `policy(context text)`, tokenised: a player of the game
    whose token ids the runner must keep exactly."""

    def __init__(self, tokenizer: Any, policy: Callable[[str], str], before: Callable[[int], None] | None = None):
        self.tokenizer, self.policy, self.before, self.calls = tokenizer, policy, before, 0
        self.sampled: list[list[int]] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: Any = None) -> list[list[Completion]]:
        if self.before is not None:
            self.before(self.calls)
        self.calls += 1
        out = []
        for p in prompts:
            ids = self.tokenizer.encode(self.policy(self.tokenizer.decode(p)), add_special_tokens=False) + [EOS_ID]
            ids = ids[: params.max_new_tokens]
            self.sampled.append(ids)
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append([Completion(tuple(ids), tuple(-0.5 for _ in ids), "stop", text)])
        return out


def bisect(context: str) -> str:
    """Binary search on the feedback so far."""
    low, high = 1, 20
    for guess, hint in re.findall(r"(\d+) is wrong: the number is (higher|lower)", context):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def run(url: str, policy: Callable[[str], str], n: int = 2, indices: tuple[int, ...] = (0, 1), before: Any = None,
        limits: Limits = Limits(max_turns=6, max_turn_tokens=16), **kwargs: Any) -> tuple[list[Any], Scripted]:
    tok = make_tiny_tokenizer()
    engine = Scripted(tok, policy, before)
    groups = episode_groups(engine, tok, env_factory("openenv"), examples({"url": url}, 4), list(indices), n, [],
                            SamplingParams(max_new_tokens=16), limits, ChatDelta(tok), [EOS_ID],
                            kwargs={"url": url, **kwargs})
    return groups, engine


def test_a_policy_plays_the_game_over_the_websocket_with_exact_ids_and_masks(guess_url: str) -> None:
    groups, engine = run(guess_url, bisect)
    tok = make_tiny_tokenizer()
    for g in groups:
        assert g.metadata["endings"] == ["done", "done"] and [s.reward for s in g.samples] == [1.0, 1.0]
        first, second = g.samples
        # one seed per prompt: both episodes face the same number, so a deterministic player plays them alike
        assert first.completion.token_ids == second.completion.token_ids
        c = first.completion
        injected = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask) if not m])
        guesses = re.findall(r"(\d+) is wrong", injected)
        assert 1 <= len(guesses) + 1 <= 5 and "Guess it" in tok.decode(first.prompt_ids)
        # token-faithful: the policy's ids are trained as they were sampled, none re-tokenised
        runs = _runs(c)
        assert len(runs) == len(guesses) + 1 and all(ids in engine.sampled for ids in runs)
        assert tok.decode(runs[-1]).startswith(bisect(tok.decode(list(first.prompt_ids) + list(c.token_ids))))
        assert set(c.turn_index) == set(range(len(guesses) + 1))
    assert groups[0].samples[0].completion.token_ids != groups[1].samples[0].completion.token_ids  # other seeds


def _runs(c: Completion) -> list[list[int]]:
    """The completion's sampled runs (loss mask 1), in order."""
    runs: list[list[int]] = []
    for t, m, turn in zip(c.token_ids, c.loss_mask, c.turn_index):
        if m:
            if not runs or runs[-1][0] != turn:
                runs.append([turn])
            runs[-1].append(t)
    return [r[1:] for r in runs]


def test_each_way_the_server_fails_ends_the_episode_infra_and_the_others_go_on(guess_url: str) -> None:
    """A step that raises in the environment (an error frame), one slower than env.kwargs.timeout,
    and a connection the server refuses for capacity: each episode ends "infra" (no verdict,
    excluded), with the others played out."""
    crashing, _ = run(guess_url, lambda c: "crash", indices=(0,), n=1)
    assert crashing[0].metadata["endings"] == ["infra"] and crashing[0].samples[0].excluded
    slow, _ = run(guess_url, lambda c: "slow", indices=(0,), n=1, timeout=0.5)
    assert slow[0].metadata["endings"] == ["infra"]

    from openenv.core.env_server.http_server import create_fastapi_app

    from rlvr.configs.openenv_server import GuessEnvironment, GuessObservation, TextAction

    one = ThreadedApp(create_fastapi_app(GuessEnvironment, TextAction, GuessObservation, max_concurrent_envs=1))
    try:
        full, _ = run(f"http://127.0.0.1:{one.port}", bisect, indices=(0,), n=2)
    finally:
        one.close()
    assert sorted(full[0].metadata["endings"]) == ["done", "infra"]


def test_each_episode_gives_its_session_back(guess_url: str) -> None:
    """A server of one session serves episode after episode: each one's session ends with it."""
    from openenv.core.env_server.http_server import create_fastapi_app

    from rlvr.configs.openenv_server import GuessEnvironment, GuessObservation, TextAction

    one = ThreadedApp(create_fastapi_app(GuessEnvironment, TextAction, GuessObservation, max_concurrent_envs=1))
    try:
        for k in range(3):
            if k:
                time.sleep(0.5)  # the close is sent in the background
            played, _ = run(f"http://127.0.0.1:{one.port}", bisect, indices=(k,), n=1)
            assert played[0].metadata["endings"] == ["done"], k
    finally:
        one.close()


def test_a_server_that_cannot_be_reached_is_refused_before_the_run_and_infra_during_it() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ConnectionError, match="cannot be reached.*env.kwargs.url"):
        check(type("Env", (), {"kwargs": {"url": dead}})())
    groups, engine = run(dead, bisect, indices=(0,), n=2)
    assert groups[0].metadata["endings"] == ["infra", "infra"]
    assert all(s.excluded for s in groups[0].samples)


def test_a_server_killed_mid_episode_ends_it_infra(tmp_path: Path) -> None:
    """A real process, SIGKILLed after the first turn: the step finds the connection gone."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "rlvr.configs.openenv_server:guess", "--port", str(port),
                             "--log-level", "warning"], cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                check(type("Env", (), {"kwargs": {"url": url}})())
                break
            except ConnectionError:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.2)

        def kill(call: int) -> None:
            if call == 1:  # after the first turn's step, before the second's
                proc.kill()
                proc.wait()

        groups, _ = run(url, bisect, indices=(3,), n=2, before=kill)
    finally:
        proc.kill()
        proc.wait()
    endings = groups[0].metadata["endings"]
    assert set(endings) <= {"infra", "done"} and "infra" in endings  # a first guess may already be right


def test_http_transport_for_a_one_step_environment(sums_url: str) -> None:
    """OpenEnv's stateless HTTP routes: the question comes from the reset, the step learns it from
    the seed the action carries (step_fields)."""
    def adder(context: str) -> str:
        a, b = map(int, re.findall(r"What is (\d) \+ (\d)", context)[-1])
        return str(a + b)

    groups, _ = run(sums_url, adder, transport="http", step_fields=["seed"])
    assert [s.reward for g in groups for s in g.samples] == [1.0] * 4
    wrong, _ = run(sums_url, lambda c: "x", transport="http", step_fields=["seed"], indices=(0,), n=1)
    assert wrong[0].samples[0].reward == pytest.approx(1 / 20)


def test_options_are_checked() -> None:
    for kwargs, message in (({}, "needs env.kwargs.url"), ({"url": "http://x", "transport": "grpc"}, "transport"),
                            ({"url": "http://x", "reward": "max"}, "reward must be"),
                            ({"url": "http://x", "retries": 2}, "unknown keyword 'retries'")):
        with pytest.raises(ValueError, match=message):
            examples(kwargs, 2)


def test_training_on_an_openenv_server_moves_the_policy(tiny_dir: Path, tmp_path: Path, sums_url: str) -> None:
    import torch

    from rlvr.config import load_config
    from rlvr.models import load_model, run_checkpoint
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    kwargs = json.dumps({"url": sums_url, "transport": "http", "step_fields": ["seed"]})
    toml_kwargs = kwargs.replace('": ', '" = ').replace('{"', "{").replace(', "', ", ").replace('" =', " =")
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "openenv", train__steps=2), 'env.name="openenv"',
                             f"env.kwargs={toml_kwargs}", "env.max_turns=1", 'rewards=[]'])
    assert cfg.task.source == "env"
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "openenv")
    assert len(rows) == 2 and rows[-1]["env/ending/done"] == pytest.approx(1.0) and rows[-1]["reward_std"] > 0
    before = load_model(str(tiny_dir), torch.float32).state_dict()
    after = load_model(str(run_checkpoint(tmp_path / "openenv")), torch.float32).state_dict()
    assert any(not torch.equal(before[k], after[k].to(before[k].dtype)) for k in before)
