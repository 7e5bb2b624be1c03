"""rlvr.runtime's malloc tuning: which mallopt settings each kind of run gets (issue 20: one
arena only where a serving thread samples beside the learner)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

import rlvr.runtime as runtime

MMAP_MAX, TRIM, ARENA_MAX = runtime._M_MMAP_MAX, runtime._M_TRIM_THRESHOLD, runtime._M_ARENA_MAX


@pytest.fixture
def mallopt(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record mallopt's calls instead of making them, from a fresh (untuned) state."""
    calls: list[tuple[int, int]] = []

    class FakeLibc:
        def mallopt(self, param: int, value: int) -> int:
            calls.append((param, value))
            return 1

    monkeypatch.setattr(runtime, "_applied", False)
    monkeypatch.setattr(runtime, "_one_arena", False)
    monkeypatch.setattr(runtime.sys, "platform", "linux")
    monkeypatch.setattr(runtime.ctypes.util, "find_library", lambda name: "libc.so.6")
    monkeypatch.setattr(runtime.ctypes, "CDLL", lambda name: FakeLibc())
    monkeypatch.delenv("RLVR_MALLOC_TUNING", raising=False)
    return calls


@pytest.mark.dtype_independent
def test_runs_keep_the_default_arenas_unless_a_server_thread_samples(mallopt: list[tuple[int, int]]) -> None:
    assert runtime.keep_freed_memory()
    assert {p for p, _ in mallopt} == {MMAP_MAX, TRIM} and not runtime.one_arena_applied()
    assert runtime.keep_freed_memory()  # once is enough
    assert len(mallopt) == 2
    assert runtime.keep_freed_memory(one_arena=True)  # a later call adds the cap, and only the cap
    assert mallopt[2:] == [(ARENA_MAX, 1)] and runtime.one_arena_applied()
    assert runtime.keep_freed_memory(one_arena=True) and len(mallopt) == 3


@pytest.mark.dtype_independent
@pytest.mark.parametrize("setting, expected", [("0", set()), ("one_arena", {MMAP_MAX, TRIM, ARENA_MAX})])
def test_the_environment_variable_turns_the_tuning_off_or_caps_every_run(
        setting: str, expected: set[int], mallopt: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_MALLOC_TUNING", setting)
    assert runtime.keep_freed_memory() == bool(expected)
    assert {p for p, _ in mallopt} == expected


@pytest.mark.dtype_independent
@pytest.mark.parametrize("env, one_arena", [(None, False), ("guess_number", False), ("openai_agent", True),
                                            ("verifiers", True)])
def test_setup_caps_the_arenas_for_environments_served_from_a_thread(
        env: str | None, one_arena: bool, monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """setup() asks first thing, before any thread allocates: the served environments (their
    episodes go through rlvr's OpenAI-compatible server in this process) get one arena."""
    from rlvr.train import setup as run

    asked: list[bool] = []

    class Stop(Exception):
        pass

    def record(one_arena: bool = False) -> bool:
        asked.append(one_arena)
        raise Stop

    monkeypatch.setattr(run, "keep_freed_memory", record)
    cfg = SimpleNamespace(env=SimpleNamespace(name=env))  # all setup reads before asking
    with pytest.raises(Stop):
        run.setup(cfg, tmp_path)  # type: ignore[arg-type]
    assert asked == [one_arena]
