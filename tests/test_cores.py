"""Torch's threads fitted to the cores other programs leave free (rlvr.cores): the rule on hand-made
readings, the clocks on this machine's /proc, and a real `rlvr train` beside a program that keeps one
of its cores busy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlvr import cores
from rlvr.bench import busy_core
from rlvr.cores import Reading, ThreadWatch, busy_elsewhere, explicit_threads, fitted

pytestmark = pytest.mark.dtype_independent


@pytest.fixture
def auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """No count fixed by the user (the suite fixes one in conftest, for reproducible numbers)."""
    monkeypatch.delenv("RLVR_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)


@pytest.mark.parametrize("busy, usable, now, expected", [
    (0.0, 2, None, 2), (0.4, 2, None, 2), (0.5, 2, None, 1), (0.67, 2, None, 1), (1.0, 2, None, 1),
    (2.0, 2, None, 1), (5.0, 2, None, 1),  # never below one thread
    (1.6, 8, None, 6), (0.0, 1, None, 1),
    # from one thread on two cores, the core is taken back only under 0.3 of it busy
    (0.4, 2, 1, 1), (0.29, 2, 1, 2), (0.31, 2, 1, 1), (0.0, 2, 1, 2),
    # from two threads, given up at half a core
    (0.49, 2, 2, 2), (0.5, 2, 2, 1),
])
def test_one_thread_per_free_core_with_a_margin_against_flapping(busy: float, usable: int, now: int | None,
                                                                 expected: int) -> None:
    assert fitted(busy, usable, now) == expected


def test_busy_elsewhere_is_the_cores_work_less_this_process_s_own_over_the_wall_time() -> None:
    before = Reading(wall=10.0, busy=100.0, own=5.0)
    # 2 s: the cores worked 3.5 s, this process 1.5 s of it: others used 2 s of CPU in 2 s, one core
    assert busy_elsewhere(before, Reading(12.0, 103.5, 6.5)) == pytest.approx(1.0)
    # ticks counted on either side of a boundary can make others' share negative: it is 0
    assert busy_elsewhere(before, Reading(12.0, 101.0, 6.5)) == 0.0
    assert busy_elsewhere(before, Reading(12.0, None, 6.5)) is None
    assert busy_elsewhere(Reading(10.0, None, 5.0), Reading(12.0, 103.0, 6.5)) is None
    assert busy_elsewhere(before, Reading(10.0, 103.0, 6.5)) is None  # no time passed


def test_the_user_s_count_wins_and_a_bad_one_is_named(monkeypatch: pytest.MonkeyPatch, auto: None) -> None:
    assert explicit_threads() is None
    monkeypatch.setenv("RLVR_THREADS", "auto")
    assert explicit_threads() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # one count per nesting level: the outer one
    assert explicit_threads() is None  # rlvr's "auto" asked for, over OpenMP's count
    monkeypatch.delenv("RLVR_THREADS")
    assert explicit_threads() == 3
    monkeypatch.setenv("RLVR_THREADS", "2")  # rlvr's own variable before OpenMP's
    assert explicit_threads() == 2
    for name, bad in (("RLVR_THREADS", "two"), ("RLVR_THREADS", "0"), ("OMP_NUM_THREADS", "-1")):
        monkeypatch.delenv("RLVR_THREADS")
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=f"{name}={bad!r}"):
            explicit_threads()


class Clocks:
    """Readings from a script: each call returns the next (wall, busy, own)."""

    def __init__(self, *readings: tuple[float, float | None, float]) -> None:
        self.readings: Iterator[tuple[float, float | None, float]] = iter(readings)

    def __call__(self) -> Reading:
        return Reading(*next(self.readings))


def test_the_first_fit_measures_since_the_command_began(monkeypatch: pytest.MonkeyPatch, auto: None) -> None:
    monkeypatch.setattr(cores, "usable_cores", lambda: 2)
    now = time.monotonic()
    chosen: list[int] = []
    # since begin: 3 s in which the cores worked 5 s, this process 2 s: others kept one core busy
    monkeypatch.setattr(cores, "_started", Reading(now - 3.0, 100.0, 1.0))
    said = cores.fit(chosen.append, Clocks((now, 105.0, 3.0)))
    assert chosen == [1] and said is not None
    assert "torch runs 1 thread on 2 cores" in said and "1.0 of them busy" in said and "OMP_NUM_THREADS" in said
    # a quiet machine: every core, nothing said
    chosen.clear()
    monkeypatch.setattr(cores, "_started", Reading(now - 3.0, 100.0, 1.0))
    assert cores.fit(chosen.append, Clocks((now, 103.2, 3.0))) is None and chosen == [2]
    # unreadable clocks: every core, as torch would
    chosen.clear()
    monkeypatch.setattr(cores, "_started", Reading(now - 3.0, None, 1.0))
    assert cores.fit(chosen.append, Clocks((now, None, 3.0))) is None and chosen == [2]


def test_a_fixed_count_is_set_or_left_to_openmp_and_nothing_is_measured(monkeypatch: pytest.MonkeyPatch,
                                                                         auto: None) -> None:
    def no_reading() -> Reading:
        raise AssertionError("a fixed count measures nothing")

    chosen: list[int] = []
    monkeypatch.setenv("RLVR_THREADS", "3")
    assert cores.fit(chosen.append, no_reading) is None and chosen == [3]
    monkeypatch.delenv("RLVR_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # torch read it at import: nothing to set
    chosen.clear()
    assert cores.fit(chosen.append, no_reading) is None and chosen == []


def test_the_watch_gives_up_a_core_while_a_program_uses_it_and_takes_it_back_after(auto: None) -> None:
    threads = [2]
    clocks = Clocks(
        (0.0, 0.0, 0.0),        # the watch starts
        (10.0, 19.0, 18.5),     # step 1: quiet (others 0.05 of a core)
        (20.0, 39.0, 31.5),     # step 2: a program started (others 0.7 of a core: taken)
        (30.1, 59.2, 45.6),     # step 3: still there (others 0.6)
        (40.1, 71.2, 55.6),     # step 4: it used 0.2: the core is taken back
        (50.2, 91.4, 75.8),     # step 5: quiet again
    )
    watch = ThreadWatch(threads.append, lambda: threads[-1], clocks, usable=2)
    metrics, note = watch.after_step()
    assert metrics == {"cpu_threads": 2.0, "cpu_busy_elsewhere": 0.05} and note is None
    metrics, note = watch.after_step()
    assert threads[-1] == 1 and metrics["cpu_threads"] == 1.0 and metrics["cpu_busy_elsewhere"] == 0.7
    assert note is not None and "0.7 of 2 cores" in note and "1 thread (was 2" in note
    metrics, note = watch.after_step()
    assert threads[-1] == 1 and note is None and metrics == {"cpu_threads": 1.0, "cpu_busy_elsewhere": 0.6}
    metrics, note = watch.after_step()
    assert threads[-1] == 2 and note is not None and "2 threads (was 1" in note
    assert watch.after_step() == ({"cpu_threads": 2.0, "cpu_busy_elsewhere": 0.0}, None)


def test_steps_shorter_than_a_window_are_read_together(auto: None) -> None:
    threads = [1]
    clocks = Clocks(
        (0.0, 0.0, 0.0),      # the watch starts
        (0.02, 0.04, 0.04),   # a 20 ms step in which the clocks ticked only for this process: 0 busy
        (0.3, 0.58, 0.3),     # still under half a second: nothing decided on 0.3 s
        (0.6, 1.2, 0.6),      # the window closes: others kept one core busy over 0.6 s
        (0.7, 1.3, 0.7),      # a new window opens
    )
    watch = ThreadWatch(threads.append, lambda: threads[-1], clocks, usable=2)
    assert watch.after_step() == ({"cpu_threads": 1.0}, None)
    assert watch.after_step() == ({"cpu_threads": 1.0}, None)
    assert watch.after_step() == ({"cpu_threads": 1.0, "cpu_busy_elsewhere": 1.0}, None)
    assert watch.after_step() == ({"cpu_threads": 1.0}, None) and threads == [1]


def test_a_fixed_count_is_reported_but_never_changed(monkeypatch: pytest.MonkeyPatch, auto: None) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    threads = [2]
    watch = ThreadWatch(threads.append, lambda: threads[-1], Clocks((0.0, 0.0, 0.0), (10.0, 20.0, 10.0)), usable=2)
    assert watch.after_step() == ({"cpu_threads": 2.0, "cpu_busy_elsewhere": 1.0}, None) and threads == [2]


def _spin(seconds: float) -> None:
    """Use `seconds` of CPU (not of wall time: on a busy machine they differ)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc")
def test_the_clocks_count_this_process_and_its_children_as_its_own() -> None:
    before = cores.read_clocks()
    assert before.busy is not None
    _spin(0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.6\n"
                              "while time.process_time() < end: pass"])
    # read while the child still runs, once it has used 0.2 s: counted from /proc, not only once reaped
    tick = os.sysconf("SC_CLK_TCK")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        stat = Path(f"/proc/{child.pid}/stat").read_text()
        if sum(int(v) for v in stat[stat.rindex(")") + 2 :].split()[11:13]) / tick >= 0.2:
            break
        time.sleep(0.01)
    middle = cores.read_clocks()
    child.wait()
    after = cores.read_clocks()
    # this process spun 0.3 s and its child ~0.6 s: both its own (/proc counts in 10 ms ticks, and
    # the child's interpreter start adds its own time)
    assert middle.own - before.own >= 0.3 + 0.2 - 0.02
    assert after.own - before.own >= 0.3 + 0.5
    # and nearly none of it is another program's: on an otherwise idle machine the rest is noise
    assert after.busy is not None and after.busy - before.busy >= (after.own - before.own) - 0.1


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="needs two cores to keep one busy")
def test_rlvr_train_beside_a_busy_core_runs_one_thread_and_says_why(tiny_dir: Path, tmp_path: Path) -> None:
    two = sorted(os.sched_getaffinity(0))[:2]
    # another program (not a child of the run) that keeps one of the run's two cores busy
    with busy_core(two[0]):
        env = {k: v for k, v in os.environ.items() if k not in ("RLVR_THREADS", "OMP_NUM_THREADS")}
        out = subprocess.run(
            [sys.executable, "-c", f"import os, sys\nos.sched_setaffinity(0, {set(two)})\n"
             "from rlvr.cli import main\nsys.exit(main())",
             "train", f"model={tiny_dir}", f"output_dir={tmp_path}", "name=busy", "train.steps=20",
             "train.prompts_per_step=4", "algo.group_size=4", "task.size=8", "task.eval_size=0",
             "sampling.max_new_tokens=48", "train.eval_every=0", "log.report=false"],
            env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch runs 1 thread on 2 cores" in out.stderr, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "busy" / "metrics.jsonl").read_text().splitlines()]
    assert [r["cpu_threads"] for r in rows] == [1.0] * 20
    # the tiny model's steps (~50-100 ms here) are read together in windows of half a second, each
    # off by at most 0.04 cores (cores.WINDOW_S): the spinning core reads as one, never under the
    # 0.3 at which the watch would take it back (CI beside mypy read 0.45-1.7 over single 15 ms steps)
    busy = [r["cpu_busy_elsewhere"] for r in rows if "cpu_busy_elsewhere" in r]
    assert busy and all(b >= cores.FREED for b in busy), busy


def test_under_a_cgroup_quota_the_cores_are_the_quota_and_busy_is_the_cgroup_s_usage(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 cores: two threads may run
    (tmp_path / "cpu.stat").write_text("usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n")
    monkeypatch.setattr(cores, "_cgroup", lambda: cores.Cgroup(tmp_path, tmp_path))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))  # a big host
    assert cores.usable_cores() == 2
    assert cores.read_clocks().busy == 2.5
    (tmp_path / "cpu.max").write_text("max 100000\n")  # no quota: the affinity, and /proc/stat
    assert cores.usable_cores() == 64
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    (tmp_path / "cpu.stat").write_text("nr_periods 0\n")  # no usage line: unreadable, not a crash
    assert cores.read_clocks().busy is None


def _v1(folder: Path, quota: int, usage_ns: int | None = None, period: int = 100000) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (folder / "cpu.cfs_period_us").write_text(f"{period}\n")
    if usage_ns is not None:
        (folder / "cpuacct.usage").write_text(f"{usage_ns}\n")


def test_cgroup_v1_quota_and_usage(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a cgroup v1 host (as Docker on older kernels): the cpu and cpuacct controllers mounted together
    mount = tmp_path / "cpu,cpuacct"
    folder = mount / "docker" / "abc"
    _v1(folder, 250000, 3_500_000_000)
    _v1(mount, -1, 9_000_000_000)  # the root: no quota
    proc = "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n"
    found = cores.find_cgroup(proc, tmp_path)
    assert found == cores.Cgroup(folder, folder, v1=True)
    assert found.quota() == 2.5 and found.used_s() == 3.5
    monkeypatch.setattr(cores, "_cgroup", lambda: found)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert cores.usable_cores() == 3 and cores.read_clocks().busy == 3.5
    # a lower quota above it binds (a systemd slice, a batch job's allocation): that one, and its usage
    _v1(mount / "docker", 150000, 5_000_000_000)
    assert cores.find_cgroup(proc, tmp_path) == cores.Cgroup(mount / "docker", mount / "docker", v1=True)
    # no quota anywhere: none, and the affinity counts
    _v1(folder, -1)
    _v1(mount / "docker", -1)
    assert cores.find_cgroup(proc, tmp_path) is None
    # inside the container the mount's root is the container's own cgroup, while /proc/self/cgroup
    # still names the host's path (not under the mount): the root is read
    _v1(mount, 50000)
    assert cores.find_cgroup("4:cpu,cpuacct:/host/path\n", tmp_path) == cores.Cgroup(mount, mount, v1=True)
    # the controllers mounted apart: the usage from cpuacct's folder at the same place
    root = tmp_path / "apart"
    _v1(root / "cpu" / "job", 200000)
    (root / "cpuacct" / "job").mkdir(parents=True)
    (root / "cpuacct" / "job" / "cpuacct.usage").write_text("1000000000\n")
    apart = cores.find_cgroup("3:cpuacct:/job\n2:cpu:/job\n", root)
    assert apart == cores.Cgroup(root / "cpu" / "job", root / "cpuacct" / "job", v1=True)
    assert apart.quota() == 2.0 and apart.used_s() == 1.0
    # no cgroup mounts at all: none
    assert cores.find_cgroup(proc, tmp_path / "none") is None


def test_cgroup_v2_found_by_its_path_or_above_it(tmp_path: Path) -> None:
    run = tmp_path / "user.slice" / "run"
    run.mkdir(parents=True)
    (run / "cpu.max").write_text("100000 100000\n")
    (tmp_path / "user.slice" / "cpu.max").write_text("max 100000\n")
    assert cores.find_cgroup("0::/user.slice/run\n", tmp_path) == cores.Cgroup(run, run)
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # the container's own, at the mount's root
    assert cores.find_cgroup("0::/elsewhere\n", tmp_path) == cores.Cgroup(tmp_path, tmp_path)
    assert cores.find_cgroup("0::/user.slice/run\n", tmp_path) == cores.Cgroup(tmp_path, tmp_path)  # the lower


@pytest.mark.skipif(not Path("/proc/self/cgroup").exists(), reason="reads /proc")
def test_this_machines_cgroup_is_read_without_error() -> None:
    found = cores._cgroup()
    if found is not None:  # v1 or v2: a quota and its usage, never a crash
        assert (found.quota() or 0) > 0 and found.used_s() > 0
    assert cores.usable_cores() >= 1


def test_a_v1_quota_without_its_usage_still_caps_the_cores_and_unlistable_mounts_are_none(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _v1(tmp_path / "cpu" / "job", 200000)  # no cpuacct mounted anywhere
    found = cores.find_cgroup("2:cpu:/job\n", tmp_path)
    assert found == cores.Cgroup(tmp_path / "cpu" / "job", None, v1=True) and found.quota() == 2.0
    monkeypatch.setattr(cores, "_cgroup", lambda: found)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert cores.usable_cores() == 2 and cores.read_clocks().busy is None  # the quota counts; busy is unknown

    def unlistable(self: Path) -> Iterator[Path]:
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "iterdir", unlistable)
    assert cores.cgroup_folders("4:memory:/job\n", "memory", tmp_path) == []  # read as no cgroup, not a crash
