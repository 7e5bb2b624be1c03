"""rlvr.runtime's malloc tuning: which mallopt settings each kind of run gets (issue 20: one
arena only where a serving thread samples beside the learner)."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import rlvr.runtime as runtime

MMAP_MAX, TRIM, ARENA_MAX = runtime._M_MMAP_MAX, runtime._M_TRIM_THRESHOLD, runtime._M_ARENA_MAX


@pytest.fixture
def mallopt(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
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
    runtime._libc.cache_clear()  # the looked-up library is cached: look up the fake one
    yield calls
    runtime._libc.cache_clear()  # and not keep it for later tests


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


GB = 10**9


def _watch(sizes: list[int], freed: int, **kw: Any) -> tuple[runtime.HeapWatch, list[dict[str, float]], list[int]]:
    """A HeapWatch over a scripted resident size: each step reads the next size; a trim gives back
    ``freed`` bytes (the next read after it sees that much less)."""
    trims: list[int] = []
    state = {"i": -1, "offset": 0}

    def resident() -> int:
        return sizes[state["i"]] - state["offset"]

    def trim() -> bool:
        trims.append(state["i"])
        state["offset"] += freed
        return True

    watch = runtime.HeapWatch(trim=trim, resident=resident, active=True, **kw)
    rows = []
    for _ in sizes:
        state["i"] += 1
        rows.append(watch.after_step())
    return watch, rows, trims


def test_the_heap_watch_trims_only_past_its_margin_and_follows_memory_the_run_keeps() -> None:
    # settles at step 3 (index 2) on 4 GB; the margin is max(1 GB, 0.5 × 4 GB) = 2 GB
    sizes = [3 * GB, 4 * GB, 4 * GB, 5 * GB, 6 * GB, int(6.5 * GB), int(6.5 * GB), 9 * GB]
    watch, rows, trims = _watch(sizes, freed=2 * GB)
    assert trims[0] == 5  # 6.5 GB is past 4 + 2; 6 GB is not
    assert rows[5] == pytest.approx({"memory_gb": 4.5, "memory_released_gb": 2.0})
    assert rows[6] == {"memory_gb": 4.5}  # the freed 2 GB stays freed; no second trim below 4.5 + 2.25
    assert rows[0] == {"memory_gb": 3.0} and "memory_released_gb" not in rows[3]
    # after the first trim the run kept 4.5 GB, the new baseline; the last step, 9 - 2 = 7 GB
    # resident, is past 4.5 + 2.25: trimmed again, down to 5 GB, the baseline from then on
    assert trims == [5, 7] and watch.trims == 2 and watch.baseline == 5 * GB


def test_the_heap_watch_only_reports_where_malloc_tuning_is_off_or_proc_is_missing() -> None:
    calls: list[int] = []
    off = runtime.HeapWatch(trim=lambda: calls.append(1) or True, resident=lambda: 50 * GB, active=False)
    assert [off.after_step() for _ in range(5)] == [{"memory_gb": 50.0}] * 5 and calls == []
    blind = runtime.HeapWatch(trim=lambda: calls.append(1) or True, resident=lambda: None, active=True)
    assert [blind.after_step() for _ in range(5)] == [{}] * 5 and calls == []


def test_the_heap_watch_reads_this_process_and_trims_for_real() -> None:
    size = runtime.resident_bytes()
    assert size is not None and 10**7 < size < 10**12  # a Python process with torch's tests loaded
    assert isinstance(runtime.give_back_freed_memory(), bool)  # glibc's malloc_trim ran (False: nothing to give)
