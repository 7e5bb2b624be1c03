"""One conformance suite for every way an episode reaches rlvr: rlvr's own environments, OpenEnv
servers, MCP tool servers, your agent over the OpenAI API, verifiers environments and Harbor
tasks. Each is played by a scripted policy (an engine whose every action is a function of what it
was shown), and each must keep the same promises:

- token faithfulness: every run of trained tokens (loss mask 1) is exactly what the engine
  sampled, ids and log-probs, so 0 tokens are re-tokenised; every other token is masked, with
  log-prob 0;
- turn indices: one per token, from 0, a turn's sampled run under one index, rising by turn;
- episode limits: a policy that never finishes ends "max_turns" after exactly env.max_turns turns;
- failures counted: an episode whose environment (or agent, or server) fails ends in a failed
  ending, excluded from the update, flagged env/error.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from rlvr.agents import Limits, StepResult
from rlvr.agents.runner import FAILED, ChatDelta, episode_groups
from rlvr.data import Example
from rlvr.types import Completion, SamplingParams
from tests.tiny import EOS_ID, make_tiny_tokenizer

pytestmark = pytest.mark.dtype_independent  # scripted policies: no model

MAX_TURNS = 5


class PolicyEngine:
    """An engine whose action for a context is `policy(context text)`, tokenised, with log-probs
    that differ by position; it keeps every (ids, log-probs) it sampled. It serves rlvr's runner
    and rlvr's OpenAI-compatible server alike (`generator`, `eos_token_ids`, `seeds`)."""

    def __init__(self, policy: Callable[[str], str]) -> None:
        self.tok = make_tiny_tokenizer()
        self.policy = policy
        self.eos_token_ids, self.pad_token_id, self.version = [EOS_ID], 0, None
        self.generator = torch.Generator().manual_seed(0)
        self.sampled: dict[tuple[int, ...], tuple[float, ...]] = {}

    def generate(self, prompts: list[list[int]], params: SamplingParams, progress: Any = None, *,
                 seeds: Any = None) -> list[list[Completion]]:
        out = []
        for p in prompts:
            text = self.policy(self.tok.decode(p))
            ids = tuple((self.tok.encode(text, add_special_tokens=False) + [EOS_ID])[: params.max_new_tokens])
            logprobs = tuple(-0.01 * (k + 1) for k in range(len(ids)))
            self.sampled[ids] = logprobs
            out.append([Completion(ids, logprobs, "stop", self.tok.decode(ids, skip_special_tokens=True))
                        for _ in range(params.n)])
        return out


@dataclass
class Protocol:
    """How one protocol runs P prompts × G episodes under a policy: `run(engine, max_turns,
    failing)`; `finishing` plays it to the end, `stubborn` never ends it, `failing` makes the
    environment's side fail for the second prompt ("What is 1 + 1?") at least."""

    run: Callable[[PolicyEngine, int, bool], list[Any]]
    finishing: Callable[[str], str]
    stubborn: Callable[[str], str]


def _examples() -> list[Example]:
    return [Example(f"What is {i} + {i}?", str(2 * i), {"answer": str(2 * i), "seed": i}, f"q/{i}") for i in range(2)]


def _runner(factory: Any, kwargs: dict[str, Any]) -> Callable[[PolicyEngine, int, bool], list[Any]]:
    def run(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        tok = engine.tok
        return episode_groups(engine, tok, factory, _examples(), [0, 1], 2, [], SamplingParams(max_new_tokens=96),
                              Limits(max_turns=max_turns, max_turn_tokens=96, max_void_turns=max_turns),
                              ChatDelta(tok), [EOS_ID], kwargs=kwargs(failing) if callable(kwargs) else kwargs)
    return run


class Countdown:
    """rlvr's own environment protocol: done when the reply says "done"; "broken" raises."""

    def __init__(self, example: Example, rewards: list[Any], fail: bool = False) -> None:
        self.fail, self.turn = fail and "1 + 1" in example.prompt, 0

    def initial_observation(self) -> str:
        return "Say done when you are done."

    def step(self, action: str) -> StepResult:
        self.turn += 1
        if self.fail:
            raise RuntimeError("the environment broke")
        if "done" in action:
            return StepResult(reward=1.0, done=True)
        return StepResult(f"Turn {self.turn} seen.")


def _native() -> Protocol:
    return Protocol(_runner(Countdown, lambda failing: {"fail": failing}),
                    lambda c: "done" if "Turn 1 seen" in c else "thinking", lambda c: "thinking")


@pytest.fixture(scope="module")
def guess_server() -> Iterator[str]:
    pytest.importorskip("openenv.core.env_server.http_server")
    from rlvr.configs.openenv_server import guess
    from rlvr.serve.server import ThreadedApp

    server = ThreadedApp(guess, name="conformance-openenv")
    yield f"http://127.0.0.1:{server.port}"
    server.close()


def _openenv(url: str) -> Protocol:
    from rlvr.agents.envs import env_factory
    from tests.test_openenv import bisect

    protocol = Protocol(_runner(env_factory("openenv"), {"url": url}),
                        bisect, lambda c: "0")  # 0 is never the number: told "higher" every turn
    run = protocol.run

    def run_failing(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        if failing:  # the environment raises in its step: an error frame
            engine.policy = lambda c: "crash"
        return run(engine, max_turns, failing)

    protocol.run = run_failing
    return protocol


MCP_SERVER = str(Path(__file__).with_name("mcp_server.py"))


def _mcp() -> Protocol:
    pytest.importorskip("mcp")
    from rlvr.agents.envs import ToolMath

    def kwargs(failing: bool) -> dict[str, Any]:
        args = [MCP_SERVER, "--conformance-dying"] if failing else [MCP_SERVER]
        return {"mcp": {"command": sys.executable, "args": args, "timeout": 20}, "python": False}

    def finishing(c: str) -> str:
        return "<answer>" + c.rsplit("Output:\n", 1)[1].split("<|im_end|>")[0] + "</answer>" if "Output:" in c \
            else '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'

    protocol = Protocol(_runner(ToolMath, kwargs), finishing,
                        lambda c: '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')
    run = protocol.run

    def run_failing(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        if failing:  # the server's process dies during the call
            engine.policy = lambda c: '<tool_call>{"name": "die", "arguments": {}}</tool_call>'
        return run(engine, max_turns, failing)

    protocol.run = run_failing
    return protocol


def _agent(client: Any, row: dict[str, Any], fail: bool = False) -> None:
    """An agent over the OpenAI API: talks until the model says done (a call past env.max_turns
    gets a 400, and the agent gives up by raising, as agents do). With `fail`, its own code breaks
    on the second prompt after one call."""
    messages = [{"role": "user", "content": row["prompt"]}]
    while True:
        if fail and "1 + 1" in row["prompt"] and len(messages) > 1:
            raise KeyError("a bug in the agent")
        reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
        if "done" in reply:
            return None
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Go on."}]


def _openai_agent() -> Protocol:
    pytest.importorskip("openai")
    from rlvr.agents.contract import as_agent
    from rlvr.agents.openai_agent import AgentLimits, agent_episode_groups

    def run(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        # failing: the agent's own code breaks on the second prompt (an engine failing a call would
        # fail whichever episodes the server batched with it)
        return agent_episode_groups(engine, engine.tok, as_agent(_agent, "test", {"fail": failing}), _examples(),
                                    [0, 1], 2, [],
                                    SamplingParams(max_new_tokens=96),
                                    AgentLimits(max_turns=max_turns, max_context=4096))

    return Protocol(run, lambda c: "done" if "Go on." in c else "thinking", lambda c: "thinking")


def _verifiers() -> Protocol:
    pytest.importorskip("verifiers")
    import verifiers as vf

    from rlvr.agents.verifiers_env import verifiers_episodes
    from tests.test_verifiers_env import Env

    def run(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        env = Env("multi", max_turns=max_turns)
        # the environment's own limit above rlvr's: env.max_turns is the one that ends the episode;
        # failing: its env_response raises on the second prompt
        env.kwargs = {"load": "tests.test_env_conformance:talk_until_done",
                      "args": {"max_turns": max_turns + 5, "fail": failing}}
        episodes = verifiers_episodes(env, engine.tok, [], SamplingParams(max_new_tokens=96))
        from rlvr.agents.verifiers_env import environment_examples

        return episodes(engine, environment_examples(env.kwargs), [0, 1], 2)

    assert vf
    return Protocol(run, lambda c: "done" if "Go on." in c else "thinking", lambda c: "thinking")


def _verifiers_v1(monkeypatch: pytest.MonkeyPatch) -> Protocol:
    pytest.importorskip("verifiers.v1")
    from tests.test_verifiers_v1 import Env, _run, install_tasksets

    install_tasksets(monkeypatch)  # its taskset package, as if installed

    def run(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        # its own limit above rlvr's; failing: its run() raises on the second prompt
        return _run(Env({"id": "vf-talk", "size": 2}, max_turns=max_turns, turns=max_turns + 5,
                        fail_on="1 + 1" if failing else ""), engine, [0, 1])

    return Protocol(run, lambda c: "done" if "Go on." in c else "thinking", lambda c: "thinking")


def talk_until_done(max_turns: int = MAX_TURNS, fail: bool = False) -> Any:
    """A verifiers MultiTurnEnv that answers "Go on." until the model says done (with `fail`, its
    env_response raises on the second prompt)."""
    import verifiers as vf

    from tests.test_verifiers_env import questions

    class Talk(vf.MultiTurnEnv):
        @vf.stop
        async def said_done(self, state: Any) -> bool:
            trajectory = state["trajectory"]
            return bool(trajectory) and "done" in (trajectory[-1]["completion"][-1].get("content") or "")

        async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
            if fail and "1 + 1" in str(messages[0]):
                raise RuntimeError("the environment broke")
            return [{"role": "user", "content": "Go on."}]

    def said_done(completion: Any, **kwargs: Any) -> float:
        return float("done" in (completion[-1]["content"] or "")) if completion else 0.0

    return Talk(dataset=questions(2), max_turns=max_turns, rubric=vf.Rubric(funcs=[said_done]))


def _harbor(folder: Path) -> Protocol:
    from rlvr import sandbox
    from rlvr.agents.envs import env_factory
    from rlvr.configs.harbor_sums import write_task

    if sandbox.bwrap_path() is None:
        pytest.skip("bubblewrap is not installed")
    for k in range(2):  # "What is 1 + 1?" and another
        write_task(folder, k)
    (folder / "sum-0001" / "instruction.md").write_text("What is 1 + 1? Write the answer to the file /app/answer.txt.")

    def run(engine: PolicyEngine, max_turns: int, failing: bool) -> list[Any]:
        if failing:  # the second task's verifier leaves no reward: no verdict
            (folder / "sum-0001" / "tests" / "test.sh").write_text("#!/bin/bash\necho forgot\n")
        exs = [ex for ex in _examples_of(folder)]
        return episode_groups(engine, engine.tok, env_factory("harbor"), exs, [0, 1], 2, [],
                              SamplingParams(max_new_tokens=96), Limits(max_turns=max_turns, max_turn_tokens=96),
                              ChatDelta(engine.tok), [EOS_ID], kwargs={"tasks": str(folder)})

    return Protocol(run, lambda c: "Done." if "(no output)" in c else "```bash\necho 2 > answer.txt\n```",
                    lambda c: "```bash\necho thinking\n```")


def _examples_of(folder: Path) -> list[Example]:
    from rlvr.agents.harbor import examples

    return examples({"tasks": str(folder)}, 0)


PROTOCOLS = ["native", "openenv", "mcp", "openai_agent", "verifiers", "verifiers_v1", "harbor"]


@pytest.fixture
def protocol(request: pytest.FixtureRequest) -> Protocol:
    name = request.param
    if name == "openenv":
        return _openenv(request.getfixturevalue("guess_server"))
    if name == "harbor":
        return _harbor(request.getfixturevalue("tmp_path"))
    if name == "verifiers_v1":
        return _verifiers_v1(request.getfixturevalue("monkeypatch"))
    return {"native": _native, "mcp": _mcp, "openai_agent": _openai_agent, "verifiers": _verifiers}[name]()


def _runs(c: Completion) -> list[tuple[int, tuple[int, ...], tuple[float, ...]]]:
    """(turn, ids, log-probs) of each run of trained tokens."""
    runs: list[tuple[int, list[int], list[float]]] = []
    mask = c.loss_mask or (1,) * len(c.token_ids)
    turns = c.turn_index or (0,) * len(c.token_ids)
    last = None
    for t, lp, m, turn in zip(c.token_ids, c.logprobs, mask, turns):
        if m and runs and last == (1, turn):
            runs[-1][1].append(t)
            runs[-1][2].append(lp)
        elif m:
            runs.append((turn, [t], [lp]))
        last = (m, turn)
    return [(turn, tuple(ids), tuple(lps)) for turn, ids, lps in runs]


def check_faithful(sample: Any, engine: PolicyEngine) -> None:
    for c in [sample.completion, *(seg[1] for seg in getattr(sample, "segments", ()) or ())]:
        mask = c.loss_mask or (1,) * len(c.token_ids)
        assert len(mask) == len(c.token_ids) == len(c.logprobs)
        runs = _runs(c)
        assert runs, "no trained tokens"
        for turn, ids, logprobs in runs:
            assert engine.sampled.get(ids) == logprobs, f"turn {turn}: trained tokens the engine did not sample as such"
        assert sum(len(ids) for _, ids, _ in runs) == sum(mask)  # 0 re-tokenised tokens
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, mask) if not m)
        if c.turn_index is not None:
            assert len(c.turn_index) == len(c.token_ids) and c.turn_index[0] == 0
            assert list(c.turn_index) == sorted(c.turn_index)
            assert [turn for turn, _, _ in runs] == sorted({turn for turn, _, _ in runs})


@pytest.mark.parametrize("protocol", PROTOCOLS, indirect=True)
def test_a_finished_episode_is_token_faithful(protocol: Protocol) -> None:
    engine = PolicyEngine(protocol.finishing)
    groups = protocol.run(engine, MAX_TURNS, False)
    assert len(groups) == 2 and all(len(g.samples) == 2 for g in groups)
    for g in groups:
        assert g.metadata["endings"] == ["done", "done"], g.metadata["endings"]
        for sample in g.samples:
            check_faithful(sample, engine)
            assert not sample.excluded and sample.reward_parts["turns"] >= 1


@pytest.mark.parametrize("protocol", PROTOCOLS, indirect=True)
def test_a_policy_that_never_finishes_ends_at_max_turns(protocol: Protocol) -> None:
    engine = PolicyEngine(protocol.stubborn)
    groups = protocol.run(engine, 2, False)
    for g in groups:
        assert g.metadata["endings"] == ["max_turns", "max_turns"], g.metadata["endings"]
        for sample in g.samples:
            assert sample.reward_parts["turns"] == 2
            check_faithful(sample, engine)


@pytest.mark.parametrize("protocol", PROTOCOLS, indirect=True)
def test_a_failure_is_counted_and_excluded(protocol: Protocol) -> None:
    engine = PolicyEngine(protocol.finishing)
    groups = protocol.run(engine, MAX_TURNS, True)
    (failed,) = [g for g in groups if "1 + 1" in g.prompt]
    assert all(e in FAILED for e in failed.metadata["endings"]), failed.metadata["endings"]
    for sample in failed.samples:
        assert sample.excluded and sample.reward_parts.get("env/error") == 1.0
