"""Torch's thread count fitted to the cores other programs leave free, and kept fitted as they come and go.

Torch starts one thread per core, and its parallel regions wait for their slowest thread. When
another program keeps one of the cores busy, one of torch's threads shares that core, and the
regions wait for the scheduler to give it a turn. A demo-sized GRPO step beside a program spinning
on one of two cores took 3.45x the quiet step on torch's two threads, and 1.44x on one (a Xeon
with AMX, `rlvr bench --parts busy`; issue 58 saw 74 s against 4-6 s on another machine;
docs/performance.md). Every laptop runs other programs.

So rlvr counts the cores it may use (its CPU affinity, capped by the lowest CPU quota of its cgroup
and those above it, cgroup v2 or v1: a container, a systemd slice, a batch job) and the cores other
programs keep busy, and runs one torch thread per free core:

- **busy** is measured, not guessed from the load average (a one-minute mean that counts this
  process too): the CPU time the usable cores spent working over a window (/proc/stat; under a
  quota, the usage of the cgroup it binds), less this process's own and its descendants' (an
  engine in a spawned process, Ray's local workers, sandboxed programs), over the window's wall
  time. Not from timing products either: alone in a loop, a decode step's products ran no slower
  beside the busy core; only a whole step shows the loss. A core counts as taken once other programs
  used half of it, and as free again when they use under 0.3 of it (so that a program near the
  line does not switch the count every step).
- **when**: first over the time from the command's start to its model loading (`begin`, then
  `fit`), so the choice costs no waiting; then over the training steps (`ThreadWatch`), whose
  readings are free: each step, or as many short steps as make `WINDOW_S`. A run that slows
  because a program started is re-fitted at the next step boundary, and one whose cores came
  free gets its threads back. Each change is said in the run's log; every step's row has
  `cpu_threads`, and each that closed a window `cpu_busy_elsewhere` (cores).
- **a user's setting wins**: `RLVR_THREADS=N`, or `OMP_NUM_THREADS` (torch's own), fixes the
  count and nothing is measured; `RLVR_THREADS=auto` fits it even where OMP_NUM_THREADS is set.
  A fixed count is also what bit-for-bit reproducible runs want: a reduction split over another
  number of threads sums in another order.

OpenMP's waiting policy is left at libgomp's default (threads spin briefly before sleeping): with
one thread per free core no thread waits on a core it shares, and making idle threads sleep at
once (OMP_WAIT_POLICY=passive) made every small product about twice as slow, quiet or busy
(docs/performance.md, session 37).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

TAKEN = 0.5
"""A core counts as taken once other programs use this much of it..."""
FREED = 0.3
"""...and as free again only when they use less than this."""
FIRST_WINDOW_S = 0.2
"""The shortest window the first fit measures over (it waits out the rest)."""
WINDOW_S = 0.5
"""The shortest window the watch decides on. The clocks count in ticks (10 ms at Linux's usual
USER_HZ of 100), the cores' time and this process's apart, so over a window of w seconds a reading
is off by up to two ticks, 0.02 / w cores: 0.04 over half a second, well inside the 0.2 between
`FREED` and `TAKEN`. Over a tiny model's 15-50 ms steps, one busy core read as 0.45-1.7 cores and
CI's run switched the count on that noise (session 39). Steps shorter than this are read together."""


@dataclass(frozen=True)
class Reading:
    """One look at the clocks: wall time, CPU seconds the usable cores worked (None: unreadable)
    and this process's own CPU seconds."""

    wall: float
    busy: float | None
    own: float


def explicit_threads() -> int | None:
    """The count the user fixed: `RLVR_THREADS`, else `OMP_NUM_THREADS`; None: rlvr fits it
    (`RLVR_THREADS=auto` asks for that even where OMP_NUM_THREADS is set). A value that is not a
    positive whole number is an error that names the variable."""
    for name in ("RLVR_THREADS", "OMP_NUM_THREADS"):
        value = os.environ.get(name, "").strip()
        if name == "RLVR_THREADS" and value == "auto":
            return None
        if value:
            try:
                count = int(value.split(",")[0])  # OMP_NUM_THREADS may list one count per nesting level
            except ValueError:
                count = 0
            if count < 1:
                raise ValueError(f"{name}={value!r}: give a positive number of threads"
                                 + (" or 'auto'" if name == "RLVR_THREADS" else ""))
            return count
    return None


@dataclass(frozen=True)
class Cgroup:
    """Where this process's cgroup keeps its CPU quota and usage: cgroup v2's one folder (cpu.max,
    cpu.stat's usage_usec), or cgroup v1's cpu controller (cpu.cfs_quota_us, cpu.cfs_period_us)
    and cpuacct controller (cpuacct.usage, in ns), often one folder mounted as cpu,cpuacct."""

    cpu: Path
    usage: Path | None  # None: a v1 quota whose cpuacct usage was not found (busy is then unknown)
    v1: bool = False

    def quota(self) -> float | None:
        """The CPU quota in cores ("200000 100000" is 2), None without one (or unreadable)."""
        try:
            if self.v1:
                quota = int((self.cpu / "cpu.cfs_quota_us").read_text())
                return None if quota < 0 else quota / int((self.cpu / "cpu.cfs_period_us").read_text())
            limit, period = (self.cpu / "cpu.max").read_text().split()[:2]
            return None if limit == "max" else int(limit) / int(period)
        except (OSError, ValueError):
            return None

    def used_s(self) -> float:
        """CPU seconds every process of the cgroup has used (raises OSError or ValueError where unreadable)."""
        if self.usage is None:
            raise OSError("no cpuacct controller at this cgroup's place")
        if self.v1:
            return int((self.usage / "cpuacct.usage").read_text()) / 1e9
        lines = (self.usage / "cpu.stat").read_text().splitlines()
        usage = next((line.split()[1] for line in lines if line.startswith("usage_usec ")), None)
        if usage is None:
            raise ValueError("cpu.stat has no usage_usec")
        return int(usage) / 1e6


CGROUP_ROOT, PROC_CGROUP = Path("/sys/fs/cgroup"), Path("/proc/self/cgroup")
"""Where cgroups are mounted, and where this process's are listed."""


def cgroup_folders(proc_cgroup: str, controller: str, root: Path = CGROUP_ROOT) -> list[tuple[Path, bool]]:
    """The folders of this process's cgroups that `controller` (e.g. "cpu", "memory") acts in, its
    own first and then those above it, each with whether it is cgroup v1: from /proc/self/cgroup's
    text (`proc_cgroup`) and the mounts under `root` (v2: one tree; v1: a mount per controller or
    group of them, e.g. "cpu,cpuacct"). A limit set above a process binds it too, and a container
    often mounts its own cgroup as the mount's root while /proc/self/cgroup names the host's path:
    the mount's root is among those above."""
    folders: list[tuple[Path, bool]] = []
    for line in proc_cgroup.splitlines():
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:  # v2: one tree for every controller
            bases, v1 = [root], False
        elif controller in controllers.split(","):
            bases, v1 = _mounts(root, controller), True
        else:
            continue
        own = Path(path.lstrip("/"))
        if ".." in own.parts:  # a cgroup outside this namespace's view: not under the mount
            continue
        folders += [(base / parent, v1) for base in bases for parent in (own, *own.parents)]
    return folders


def find_cgroup(proc_cgroup: str, root: Path = CGROUP_ROOT) -> Cgroup | None:
    """The cgroup whose CPU quota binds this process (`cgroup_folders`: the lowest quota of its own
    and those above it), or None where none has one."""
    found = []
    for folder, v1 in cgroup_folders(proc_cgroup, "cpu", root):
        if (quota := Cgroup(folder, None, v1).quota()) is not None:  # the usage looked for only where one binds
            found.append((quota, Cgroup(folder, _v1_usage(folder, root) if v1 else folder, v1)))
    return min(found, key=lambda q: q[0])[1] if found else None


def _mounts(root: Path, controller: str) -> list[Path]:
    """The cgroup v1 mounts under `root` that `controller` is in ("cpu,cpuacct" holds two)."""
    try:
        return [d for d in sorted(root.iterdir()) if controller in d.name.split(",")]
    except OSError:  # no cgroup mounts, or none this process may list
        return []


def _v1_usage(cpu_folder: Path, root: Path) -> Path | None:
    """The cpuacct folder at the place of the v1 cpu controller's `cpu_folder`: the folder itself
    where the two are mounted together, else the same path under cpuacct's mount."""
    if (cpu_folder / "cpuacct.usage").exists():
        return cpu_folder
    place = Path(*cpu_folder.relative_to(root).parts[1:])  # below the mount
    return next((m / place for m in _mounts(root, "cpuacct") if (m / place / "cpuacct.usage").exists()), None)


def _cgroup() -> Cgroup | None:
    """The cgroup whose CPU quota binds this process (`find_cgroup`), None where none has one."""
    try:
        return find_cgroup(PROC_CGROUP.read_text())
    except OSError:
        return None


def usable_cores() -> int:
    """The cores this process may run on: its affinity, capped by a cgroup CPU quota (rounded up)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    cgroup = _cgroup()
    quota = cgroup.quota() if cgroup else None
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _own_seconds() -> float:
    """CPU seconds of this process and all its live descendants, with the children each has reaped
    (/proc): an engine in a spawned process (vLLM), Ray's local workers and sandboxed programs are
    this run's own work, not another program's."""
    try:
        names = [e.name for e in os.scandir("/proc") if e.name.isdigit()]
    except OSError:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system
    parent, spent = {}, {}
    for name in names:
        try:
            text = Path("/proc", name, "stat").read_text()
        except OSError:  # it ended meanwhile
            continue
        rest = text[text.rindex(")") + 2:].split()  # after the command name, which may hold spaces
        parent[int(name)], spent[int(name)] = int(rest[1]), sum(int(v) for v in rest[11:15])  # utime .. cstime
    children: dict[int, list[int]] = {}
    for pid, ppid in parent.items():
        children.setdefault(ppid, []).append(pid)
    total, stack = 0, [os.getpid()]
    while stack:
        pid = stack.pop()
        total += spent.get(pid, 0)
        stack += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")


def read_clocks() -> Reading:
    """The clocks now: under a CPU quota the cgroup's usage (`Cgroup.used_s`), else the usable cores'
    non-idle time in /proc/stat (user, nice, system, irq, softirq and steal: a hypervisor's steal
    is a core this process did not get)."""
    wall, own = time.monotonic(), _own_seconds()
    cgroup = _cgroup()
    try:
        if cgroup is not None:  # one with a quota (`find_cgroup`)
            return Reading(wall, cgroup.used_s(), own)
        cpus = {f"cpu{i}" for i in (os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ())}
        busy = 0
        for line in Path("/proc/stat").read_text().splitlines():
            fields = line.split()
            if fields and fields[0] in cpus:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[1:9])
                busy += user + nice + system + irq + softirq + steal
        return Reading(wall, busy / os.sysconf("SC_CLK_TCK") if cpus else None, own)
    except (OSError, ValueError, IndexError):
        return Reading(wall, None, own)


def busy_elsewhere(before: Reading, after: Reading) -> float | None:
    """Cores other programs kept busy between two readings (None where the clocks were unreadable
    or no time passed)."""
    wall = after.wall - before.wall
    if before.busy is None or after.busy is None or wall <= 0:
        return None
    return max(0.0, (after.busy - before.busy) - (after.own - before.own)) / wall


def fitted(busy: float, usable: int, now: int | None = None) -> int:
    """Threads for `usable` cores of which other programs keep `busy` cores busy: one per free core,
    at least one. From `now` threads, a core is given up once others take `TAKEN` of it and taken
    back only when they use less than `FREED` of it."""
    down = max(1, usable - math.floor(busy + 1 - TAKEN))
    up = max(1, usable - math.floor(busy + 1 - FREED))
    if now is None:
        return down
    return down if down < now else up if up > now else now


_started: Reading | None = None


def begin() -> None:
    """Start the first window (the command's start; `fit` ends it)."""
    global _started
    _started = read_clocks()


def fit(set_threads: Callable[[int], None] | None = None, read: Callable[[], Reading] = read_clocks) -> str | None:
    """Set torch's threads to the free cores, measured since `begin` (or over `FIRST_WINDOW_S` from
    now), unless the user fixed the count; returns what it chose and why (None: nothing to say,
    every usable core is used). Call before a model loads: rlvr measures some choices per thread
    count (rlvr.attention)."""
    global _started
    fixed = explicit_threads()
    set_threads = set_threads or torch.set_num_threads
    if fixed is not None:
        if os.environ.get("RLVR_THREADS", "").strip():
            set_threads(fixed)  # OMP_NUM_THREADS is read by torch itself
        return None
    start = _started or read()
    _started = None
    wait = FIRST_WINDOW_S - (time.monotonic() - start.wall)
    if wait > 0:
        time.sleep(wait)
    usable, busy = usable_cores(), busy_elsewhere(start, read())
    threads = usable if busy is None else fitted(busy, usable)
    set_threads(threads)
    if threads == usable:
        return None
    return (f"torch runs {threads} thread{'s' * (threads > 1)} on {usable} cores: other programs kept {busy:.1f} "
            f"of them busy, and a thread that shares its core with another program slows every product "
            f"(OMP_NUM_THREADS or RLVR_THREADS fixes the count)")


class ThreadWatch:
    """Re-fits the threads after a training step from what other programs used since the last fit, once
    that window is `WINDOW_S` long (see the module docstring). ``after_step`` returns the step's
    metrics (``cpu_busy_elsewhere`` where a window closed) and a note when the count changed."""

    def __init__(self, set_threads: Callable[[int], None] | None = None, get_threads: Callable[[], int] | None = None,
                 read: Callable[[], Reading] = read_clocks, usable: int | None = None) -> None:
        self.set_threads, self.get_threads = set_threads or torch.set_num_threads, get_threads or torch.get_num_threads
        self.read = read
        self.active = explicit_threads() is None
        self.usable = usable or usable_cores()
        self.last = read()

    def after_step(self) -> tuple[dict[str, float], str | None]:
        now, reading = self.get_threads(), self.read()
        metrics = {"cpu_threads": float(now)}
        if reading.wall - self.last.wall < WINDOW_S:
            return metrics, None  # read with the next steps
        busy, self.last = busy_elsewhere(self.last, reading), reading
        if busy is None:
            return metrics, None
        metrics["cpu_busy_elsewhere"] = round(busy, 2)
        if not self.active:
            return metrics, None
        threads = fitted(busy, self.usable, now)
        if threads == now:
            return metrics, None
        self.set_threads(threads)
        metrics["cpu_threads"] = float(threads)
        note = (f"other programs used {busy:.1f} of {self.usable} cores since the last reading: torch now runs "
                f"{threads} thread{'s' * (threads > 1)} (was {now}; OMP_NUM_THREADS or RLVR_THREADS fixes the count)")
        log.info(note)
        return metrics, note
