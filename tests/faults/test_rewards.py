"""Faults of rewards, the sandbox and agents: each failure is scored by the configured policy and
counted, or stops the run saying so; never a hang, never an infrastructure failure trained on as
the model's. (A fresh review, session 22, found a hung reward that kept `rlvr train` alive after
its last line and, once eight calls hung, scored every user reward 0; a generator reward that
escaped its time limit and its error handling; a server error an agent caught, trained as the
model's 0; and a missing sandbox found only at the first completion with code in it.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import openai
import pytest

from rlvr.rewards import combine
from rlvr.rewards.combine import RewardError, RewardFn, build_rewards, score, score_group

pytestmark = pytest.mark.dtype_independent  # what these faults end in does not depend on "auto" precision

RELEASE = threading.Event()


def _hangs(prompt: str, completion: str, **_: Any) -> float:
    RELEASE.wait()
    return 1.0


def test_a_hung_reward_neither_keeps_the_process_alive_nor_holds_up_the_others() -> None:
    """Eight hung calls filled the shared pool of eight threads: every later call of any user
    reward waited in its queue past its limit and scored 0, and the interpreter waited for the
    hung threads at exit (`rlvr train` printed its last line and never ended)."""
    script = textwrap.dedent("""
        import threading, time
        from rlvr.rewards.combine import RewardFn, score
        never = threading.Event()
        hang = [RewardFn("h", lambda p, c, **_: never.wait(), 1.0, {}, timeout_s=0.05)]
        ok = [RewardFn("ok", lambda p, c, **_: 1.0, 1.0, {}, timeout_s=5.0)]
        for _ in range(7):
            assert score(hang, "p", "c", {}) == (0.0, {"h": 0.0, "h/error": 1.0})
        print(score(ok, "p", "c", {}))
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).parents[2])
    assert done.returncode == 0, done.stderr
    assert "(1.0, {'ok': 1.0})" in done.stdout and time.monotonic() - start < 30


def test_a_reward_that_keeps_hanging_stops_the_run_naming_it() -> None:
    combine._STUCK.clear()
    hang = [RewardFn("stuck", _hangs, 1.0, {}, timeout_s=0.01)]
    try:
        for _ in range(combine.MAX_STUCK):
            assert score(hang, "p", "c", {}) == (0.0, {"stuck": 0.0, "stuck/error": 1.0})
        with pytest.raises(RewardError, match="reward 'stuck' has 8 calls still running past its timeout_s"):
            score(hang, "p", "c", {})
    finally:
        RELEASE.set()  # the threads end; the next test starts clean
        combine._STUCK.clear()


def _generator_raises(prompt: str, completions: list[str], **_: Any) -> Any:
    yield 1.0
    raise KeyError("inside the generator")


def _generator_hangs(prompt: str, completions: list[str], **_: Any) -> Any:
    yield 1.0
    time.sleep(3)
    yield 1.0


def test_a_generator_group_reward_is_listed_inside_its_limits() -> None:
    """Its values were listed after the call returned, outside the try and the time limit: one that
    raised crashed the step, one that hung ignored timeout_s."""
    raises = [RewardFn("g", _generator_raises, 1.0, {}, timeout_s=5.0, group=True)]
    assert [p for _, p in score_group(raises, "p", ["a", "b"], {})] == [{"g": 0.0, "g/error": 1.0}] * 2
    hangs = [RewardFn("g", _generator_hangs, 1.0, {}, timeout_s=0.2, group=True)]
    start = time.monotonic()
    assert [p for _, p in score_group(hangs, "p", ["a", "b"], {})] == [{"g": 0.0, "g/error": 1.0}] * 2
    assert time.monotonic() - start < 2


def test_numbers_beyond_a_float_are_failures_not_a_crash() -> None:
    """10**400 raised OverflowError out of the checks; two rewards of 1e308 × weight 10 made an
    infinite total that crashed the advantages with a traceback naming no reward."""
    huge = [RewardFn("a", lambda p, c, **_: 10**400, 1.0, {})]
    assert score(huge, "p", "c", {}) == (0.0, {"a": 0.0, "a/error": 1.0})
    heavy = [RewardFn("b", lambda p, c, **_: 1e308, 10.0, {})]
    assert score(heavy, "p", "c", {}) == (0.0, {"b": 0.0, "b/error": 1.0})


def _raises(prompt: str, completion: str, **_: Any) -> float:
    raise KeyError("a bug in the reward")


def test_the_runs_failure_policy_reaches_every_caller_of_the_rewards() -> None:
    """on_reward_error = "stop" was passed by the loop's scoring only: an environment's or an
    agent's own scoring ran with the default and trained on zeros. The rewards carry it now."""
    rewards = build_rewards([{"fn": "tests.faults.test_rewards:_raises"}], on_error="stop")
    with pytest.raises(RewardError, match="a bug in the reward"):
        score_group(rewards, "p", ["c"], {})  # as rlvr.agents.envs and the OpenAI agent call it
    assert score_group(rewards, "p", ["c"], {}, on_error="zero")[0] == (0.0, {"_raises": 0.0, "_raises/error": 1.0})


def test_a_missing_sandbox_is_found_before_the_first_step(tiny_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A code reward met the missing sandbox at the first completion with code in it, possibly
    hours in, with every step since the last checkpoint lost. `rlvr train` now checks it first,
    and a new run that cannot start leaves no directory behind."""
    from rlvr import sandbox
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_checked", {})
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "code"), 'rewards=[{fn = "unit_tests"}]'])
    with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
        train(cfg, quiet=True)
    assert not (tmp_path / "code").exists()


def test_an_engine_failure_the_agent_caught_is_not_scored_as_the_models_answer(caplog: Any) -> None:
    """The server answered 500 (the engine failed); the agent caught it and answered anyway. Its
    episode was trained as the model's reward of 0; it is now an infrastructure failure, excluded
    and counted, and the log says why. (The first example's episode ends before the second's call
    fails, so the two are never in one failing batch.)"""
    import asyncio

    from rlvr.rollout.engine import EmbeddedEngine
    from tests.test_openai_agent import run

    real = EmbeddedEngine.generate

    def breaks_on_request(self: EmbeddedEngine, prompts: list[list[int]], *args: Any, **kwargs: Any) -> Any:
        if any("break now" in self.tokenizer.decode(p) for p in prompts):
            raise RuntimeError("the engine broke")
        return real(self, prompts, *args, **kwargs)

    first_done: dict[str, asyncio.Event] = {}

    async def agent(client: openai.AsyncOpenAI, row: dict[str, Any]) -> str:
        done = first_done.setdefault("event", asyncio.Event())
        if row["id"] == "ex0":
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["prompt"]}])
            done.set()
            return "done"
        await done.wait()
        try:
            await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "break now"}])
        except openai.APIError:
            return ""  # "no answer": scored by the rewards as the model's
        return "done"

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EmbeddedEngine, "generate", breaks_on_request)
        groups = run(agent, n=1)
    (ok,), (failed,) = (g.samples for g in groups)
    assert not ok.excluded and ok.reward_parts.get("env/error") is None
    assert failed.excluded and failed.reward_parts.get("env/error") == 1.0
    assert "a call could not be served" in caplog.text and "the engine broke" in caplog.text


@pytest.mark.parametrize(("returns", "parts"), [
    (KeyError("a bug"), {"r": 0.0, "r/error": 1.0}),           # raises: scored 0, counted
    (float("nan"), {"r": 0.0, "r/error": 1.0}),                # not finite: the same
    (float("-inf"), {"r": 0.0, "r/error": 1.0}),
    ("1.0", {"r": 0.0, "r/error": 1.0}),                       # not a number
    (None, {"r": 0.0, "r/excluded": 1.0}),                     # no verdict: out of the update
    (ConnectionResetError("the judge hung up"), {"r": 0.0, "r/error": 1.0, "r/excluded": 1.0}),  # infrastructure
])
def test_a_reward_that_fails_is_scored_by_the_policy_and_counted(returns: Any, parts: dict[str, float]) -> None:
    def reward(prompt: str, completion: str, **_: Any) -> Any:
        if isinstance(returns, BaseException):
            raise returns
        return returns

    assert score([RewardFn("r", reward, 1.0, {}, timeout_s=5.0)], "p", "c", {}) == (0.0, parts)


@pytest.mark.parametrize("returns", [[1.0], [1.0, 1.0, 1.0], 1.0, {"a": 1.0}, None])
def test_a_group_reward_with_the_wrong_count_is_a_counted_failure(returns: Any) -> None:
    group = [RewardFn("g", lambda p, cs, **_: returns, 1.0, {}, timeout_s=5.0, group=True)]
    assert [p for _, p in score_group(group, "p", ["a", "b"], {})] == [{"g": 0.0, "g/error": 1.0}] * 2


def test_a_bubblewrap_that_cannot_start_is_found_before_the_first_step(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bwrap that fails (no user namespaces in this container, say): the same check, its reason."""
    from rlvr import sandbox
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides

    import shutil
    import tempfile

    folder = Path(tempfile.mkdtemp())  # (the sandbox's probe drops privileges: pytest's folders are the user's)
    folder.chmod(0o755)
    fake = folder / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox, "_checked", {})
    monkeypatch.setattr(sandbox, "bwrap_path", lambda: str(fake))
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "code"), 'rewards=[{fn = "unit_tests"}]'])
    try:
        with pytest.raises(sandbox.SandboxUnavailable, match="cannot create namespaces here.*No permissions"):
            train(cfg, quiet=True)
    finally:
        shutil.rmtree(folder)
