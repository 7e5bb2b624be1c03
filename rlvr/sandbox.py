"""Run untrusted code (what a model wrote) in isolation: no network, no host files, hard limits.

Isolation is bubblewrap (`bwrap`, Debian package `bubblewrap`), the sandbox Flatpak is built on.
Each run gets:

- new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`): only a loopback
  interface, no host process visible or signalable, a private hostname;
- a filesystem made of the read-only system runtime (`/usr` and its `/bin`, `/lib` links), a
  private `/proc` and `/dev`, a size-capped tmpfs at `/tmp` (the working directory), and the
  program itself at `/sandbox/main.py` (read-only); no home, no `/etc`, no project files;
- an empty environment (only PATH, HOME=/tmp, LANG and PWD are set);
- a host user of its own (uid 60000 + slot, never root), so its process limit is its own;
- rlimits: CPU seconds, address space, processes, file size, open files;
- a wall-clock timeout and an output cap, after which the whole process tree is killed (the
  sandbox's PID 1 is bwrap's child, which dies with bwrap, and every process of a PID namespace
  dies with its PID 1).

`isolation = "none"` runs the same program with the same rlimits and a clean environment but no
namespaces, only after the user asked for it; it warns on every run.

`rlvr sandbox run FILE` runs a file this way and prints the JSON result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import IO, Literal

Isolation = Literal["auto", "bwrap", "none"]
LimitKind = Literal["cpu", "memory", "file_size", "output"]

_BASE_UID = 60000  # host uids for sandbox slots: 60000 + slot (no such users need to exist)
_RUNTIME_PYTHON = "/usr/bin/python3"


class SandboxUnavailable(RuntimeError):
    """No isolation could be set up; the message says how to fix it."""


@dataclass(frozen=True)
class Limits:
    """What one run may use."""

    timeout_s: float = 10.0
    """Wall clock; the whole process tree is killed after it."""
    cpu_s: int = 10
    """CPU seconds (RLIMIT_CPU): SIGXCPU, then SIGKILL."""
    memory_mb: int = 512
    """Address space (RLIMIT_AS): allocations beyond it fail (MemoryError in Python)."""
    max_processes: int = 32
    """Processes and threads of the run's user (RLIMIT_NPROC): a fork bomb gets EAGAIN."""
    file_size_mb: int = 16
    """Largest file it may write (RLIMIT_FSIZE): SIGXFSZ."""
    tmp_mb: int = 64
    """Size of its private /tmp."""
    open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    output_bytes: int = 1 << 20
    """stdout and stderr are each kept up to this size; more kills the run."""

    def __post_init__(self) -> None:
        bad = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) <= 0]
        if bad:
            raise ValueError(f"sandbox limits must be positive: {', '.join(bad)}")


@dataclass(frozen=True)
class Result:
    """The outcome of one run, JSON-ready (`dataclasses.asdict`)."""

    exit_code: int | None
    """The program's exit status; killed by signal n: 128 + n (isolated: bwrap reports it so) or
    -n (unisolated); None if it never started."""
    stdout: str
    stderr: str
    timed_out: bool
    killed_by_limit: LimitKind | None
    """Which limit stopped it: cpu, memory, file_size or output (None: none did, or a timeout)."""
    duration_s: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out and self.killed_by_limit is None

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))


def bwrap_path() -> str | None:
    return shutil.which("bwrap")


_checked: dict[str, str] = {}


def check_isolation(isolation: Isolation) -> str:
    """The isolation that will be used ("bwrap" or "none"), or SandboxUnavailable saying why not."""
    if isolation == "none":
        return "none"
    if "bwrap" in _checked:
        return _checked["bwrap"]
    path = bwrap_path()
    if path is None:
        raise SandboxUnavailable(
            "no sandbox: bubblewrap (bwrap) is not installed. Install it (Debian/Ubuntu: apt-get install "
            "bubblewrap; Fedora: dnf install bubblewrap; `make setup` does it where it can), or run model-written "
            'code unisolated at your own risk with sandbox.isolation = "none"')
    if not os.path.exists(_RUNTIME_PYTHON):
        raise SandboxUnavailable(f"no sandbox: the sandbox runs {_RUNTIME_PYTHON}, which this system lacks "
                                 "(install the distribution's python3)")
    done = subprocess.run(_bwrap_command(["/bin/true"], Limits(), {}), capture_output=True, text=True,
                          preexec_fn=_preexec(Limits(), slot=0),
                          env={}, timeout=30)
    if done.returncode != 0:
        raise SandboxUnavailable(
            f"no sandbox: bubblewrap is installed but cannot create namespaces here ({done.stderr.strip()[:300]}). "
            "Unprivileged user namespaces must be enabled (sysctl kernel.unprivileged_userns_clone=1, or "
            "user.max_user_namespaces > 0), or in a container, allow them (e.g. docker --security-opt "
            'seccomp=unconfined); or opt out with sandbox.isolation = "none"')
    _checked["bwrap"] = "bwrap"
    return "bwrap"


def _preexec(limits: Limits, slot: int) -> Callable[[], None]:
    """Runs in the child between fork and exec: its own session (so the whole group can be
    killed), the rlimits, and (as root) a dedicated unprivileged user."""

    def setup() -> None:
        os.setsid()
        mb = 1 << 20
        resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s + 1))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_mb * mb, limits.memory_mb * mb))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_size_mb * mb, limits.file_size_mb * mb))
        resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if os.geteuid() == 0:
            uid = _BASE_UID + slot
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        # after the uid change: root is exempt from RLIMIT_NPROC, the sandbox user is not
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))

    return setup


def _bwrap_command(argv: list[str], limits: Limits, fds: dict[str, int]) -> list[str]:
    """bubblewrap around `argv`: see the module docstring; `fds` are memfds mounted read-only in /sandbox."""
    cmd = [bwrap_path() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
           "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
           "--proc", "/proc", "--dev", "/dev", "--size", str(limits.tmp_mb << 20), "--tmpfs", "/tmp",
           "--hostname", "sandbox", "--dir", "/sandbox", "--chdir", "/tmp",
           "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    for name, fd in fds.items():
        cmd += ["--perms", "0444", "--ro-bind-data", str(fd), f"/sandbox/{name}"]
    return cmd + ["--", *argv]


class Sandbox:
    """Runs Python programs or shell commands in isolation; thread-safe, one run per slot at a time."""

    def __init__(self, isolation: Isolation = "auto", limits: Limits | None = None) -> None:
        self.isolation = isolation
        self.limits = limits or Limits()

    def run_python(self, code: str, stdin: str = "", *, files: dict[str, str] | None = None,
                   limits: Limits | None = None, slot: int = 0) -> Result:
        """Run `code` as /sandbox/main.py (`files` are put beside it, read-only)."""
        return self._run([_RUNTIME_PYTHON, "-E", "-s", "-B", "/sandbox/main.py"], {"main.py": code, **(files or {})},
                         stdin, limits or self.limits, slot)

    def run_shell(self, command: str, stdin: str = "", *, files: dict[str, str] | None = None,
                  limits: Limits | None = None, slot: int = 0) -> Result:
        """Run `command` with /bin/sh -c (the runtime's tools only), files in /sandbox."""
        return self._run(["/bin/sh", "-c", command], files or {}, stdin, limits or self.limits, slot)

    def _run(self, argv: list[str], files: dict[str, str], stdin: str, limits: Limits, slot: int) -> Result:
        mode = check_isolation(self.isolation)
        isolated = mode == "bwrap"
        for name in files:
            if "/" in name or name in ("", ".", ".."):
                raise ValueError(f"sandbox file names are plain names, got {name!r}")
        fds: dict[str, int] = {}
        workdir = None
        try:
            if isolated:
                for name, text in files.items():
                    fd = os.memfd_create(f"sandbox-{name}", 0)
                    os.write(fd, text.encode())
                    os.lseek(fd, 0, os.SEEK_SET)
                    fds[name] = fd
                cmd = _bwrap_command(argv, limits, fds)
                env = None
                cwd = None
            else:
                warnings.warn('sandbox.isolation = "none": model-written code runs on this host unisolated '
                              "(no namespaces; only rlimits and a clean environment)", RuntimeWarning, stacklevel=3)
                workdir = tempfile.mkdtemp(prefix="rlvr-sandbox-")
                for name, text in files.items():
                    with open(os.path.join(workdir, name), "w") as f:
                        f.write(text)
                os.chmod(workdir, 0o777)
                cmd = [a.replace("/sandbox/", workdir + "/") for a in argv]
                env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
                cwd = workdir
            return _execute(cmd, stdin, limits, slot, fds, env, cwd, mode)
        finally:
            for fd in fds.values():
                os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)


def _execute(cmd: list[str], stdin: str, limits: Limits, slot: int, fds: dict[str, int],
             env: dict[str, str] | None, cwd: str | None, mode: str) -> Result:
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=tuple(fds.values()), env=env if env is not None else {}, cwd=cwd,
                                preexec_fn=_preexec(limits, slot))
    except OSError as exc:
        return Result(None, "", f"could not start: {exc}", False, None, time.monotonic() - start, mode)
    overflow = threading.Event()
    out, err = _Capture(proc.stdout, limits.output_bytes, overflow), _Capture(proc.stderr, limits.output_bytes, overflow)
    feeder = threading.Thread(target=_feed, args=(proc.stdin, stdin.encode()), daemon=True)
    for t in (out.thread, err.thread, feeder):
        t.start()
    timed_out = False
    deadline = start + limits.timeout_s
    while proc.poll() is None:
        if overflow.is_set():
            break
        if time.monotonic() > deadline:
            timed_out = True
            break
        time.sleep(0.01)
    if proc.poll() is None:
        _kill_tree(proc, isolated=mode == "bwrap")
    proc.wait()
    for t in (out.thread, err.thread):
        t.join(timeout=5)
    duration = time.monotonic() - start
    code = proc.returncode
    stderr = err.text()
    limit: LimitKind | None = None
    if overflow.is_set():
        limit = "output"
    elif code in (-signal.SIGXCPU, 128 + signal.SIGXCPU):
        limit = "cpu"
    elif code in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or "File too large" in stderr:
        limit = "file_size"
    elif "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        limit = "memory"
    return Result(code, out.text(), stderr, timed_out, limit, duration, mode)


def _kill_tree(proc: subprocess.Popen[bytes], isolated: bool) -> None:
    """Kill everything the run started.

    Isolated: SIGKILL bwrap's child, the PID namespace's init, which takes every process of the
    namespace with it; bwrap then exits and is reaped here, and so reaps its child (killing bwrap
    itself first would orphan that child to a PID 1 that may never reap it). Then, and without
    isolation, SIGKILL the whole process group."""
    if isolated:
        try:
            children = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()
        except OSError:
            children = []
        for child in children:
            try:
                os.kill(int(child), signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            proc.wait(timeout=2)
            return
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _feed(pipe: IO[bytes] | None, data: bytes) -> None:
    if pipe is None:
        return
    try:
        pipe.write(data)
        pipe.close()
    except (BrokenPipeError, OSError):
        pass


class _Capture:
    """Reads a pipe to its end, keeping at most `cap` bytes; sets `overflow` past that."""

    def __init__(self, pipe: IO[bytes] | None, cap: int, overflow: threading.Event) -> None:
        self.chunks: list[bytes] = []
        self.size, self.cap, self.overflow = 0, cap, overflow
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)

    def _read(self, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536):
            room = self.cap - self.size
            if room > 0:
                self.chunks.append(chunk[:room])
            self.size += len(chunk)
            if self.size > self.cap:
                self.overflow.set()
        pipe.close()

    def text(self) -> str:
        return b"".join(self.chunks).decode(errors="replace")


class SandboxPool:
    """Runs many programs at once, at most `parallelism` at a time, each in its own slot (its own
    host user, so one run's process limit does not starve another's)."""

    def __init__(self, sandbox: Sandbox, parallelism: int = 4) -> None:
        if parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {parallelism}")
        self.sandbox, self.parallelism = sandbox, parallelism
        self._free = list(range(parallelism))
        self._lock = threading.Lock()

    def run_python(self, programs: list[tuple[str, str]], files: list[dict[str, str]] | None = None) -> list[Result]:
        """Results of (code, stdin) pairs, in order."""
        check_isolation(self.sandbox.isolation)  # fail once, clearly, before starting anything

        def one(i: int) -> Result:
            with self._lock:
                slot = self._free.pop()
            try:
                code, stdin = programs[i]
                return self.sandbox.run_python(code, stdin, files=files[i] if files else None, slot=slot)
            finally:
                with self._lock:
                    self._free.append(slot)

        with ThreadPoolExecutor(self.parallelism) as pool:
            return list(pool.map(one, range(len(programs))))


_default: dict[str, SandboxPool] = {}


def configure(isolation: Isolation = "auto", limits: Limits | None = None, parallelism: int = 2) -> SandboxPool:
    """Set the sandbox pool that rewards use (`rlvr train` does this from the config's `sandbox` section)."""
    _default["pool"] = SandboxPool(Sandbox(isolation, limits), parallelism)
    return _default["pool"]


def default_pool() -> SandboxPool:
    """The configured pool, or one with the default settings."""
    return _default.get("pool") or configure()
