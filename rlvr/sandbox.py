"""Run untrusted code (what a model wrote) in isolation: no network, no host files, hard limits.

Isolation is bubblewrap (`bwrap`, Debian package `bubblewrap`), the sandbox Flatpak is built on.
Each run gets:

- new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all`): only a loopback
  interface, no host process visible or signalable, a private hostname;
- a filesystem made of the read-only system runtime (`/usr` and its `/bin`, `/lib` links), a
  private `/proc` and `/dev`, a size-capped tmpfs at `/tmp` (the working directory), and the
  program itself at `/sandbox/main.py` (read-only); no home, no `/etc`, no project files; only
  `/tmp` (HOME) and bubblewrap's private `/dev` can be written: the root is read-only, so no run
  can create an `/etc` file that a library would read;
- an empty environment (only PATH, HOME=/tmp, LANG and PWD are set);
- a host user of its own when rlvr runs as root (uid 60000 + slot, never root);
- rlimits: CPU seconds, address space, file size, open files, and processes. The process limit
  is set *inside* the run's user namespace (by util-linux's ``prlimit`` as the run's first
  command), where the kernel (Linux >= 5.14) counts only that namespace's processes: other runs'
  processes, still exiting or running side by side in another rlvr process with the same uid,
  never use up this run's allowance. Set on the host, RLIMIT_NPROC counts every process of the
  uid on the machine, and back-to-back runs failed to start ("Can't fork", EAGAIN) while earlier
  ones' processes were still around;
- a wall-clock timeout and an output cap, after which the whole process tree is killed (the
  sandbox's PID 1 is bwrap's child, which dies with bwrap, and every process of a PID namespace
  dies with its PID 1).

`isolation = "none"` runs the same program with the same rlimits and a clean environment but no
namespaces, only after the user asked for it; it warns on every run. Its process limit is the
uid's processes at launch plus ``max_processes``.

A run that the sandbox itself could not carry out is not the program's failure. The run's first
command writes a start marker on stderr before it execs the program, so a run without the marker
never started (bwrap could not fork or set up the namespaces, the host was out of processes or
memory); a run whose bubblewrap was killed by a signal rlvr did not send was cut short from
outside. Either is retried (``ATTEMPTS`` in all, with a short backoff), and if every attempt
fails, ``SandboxError`` is raised: an ``InfrastructureError``, which rewards count as
``<name>/error`` and exclude from the update instead of scoring 0.

`rlvr sandbox run FILE` runs a file this way and prints the JSON result.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import select
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
from typing import IO, Literal, overload

from rlvr.errors import InfrastructureError, SandboxUnavailable

Isolation = Literal["auto", "bwrap", "none"]
LimitKind = Literal["cpu", "memory", "file_size", "output"]

_BASE_UID = 60000  # host uids for sandbox slots: 60000 + slot (no such users need to exist)
_RUNTIME_PYTHON = "/usr/bin/python3"
_PRLIMIT = "/usr/bin/prlimit"
_STARTED = b"\x1erlvr-sandbox-started\n"  # the launcher's first bytes on stderr, before the program exists
_STARTED_PRINTF = r"\036rlvr-sandbox-started\n"  # the same, as printf writes it
ATTEMPTS = 3
"""Tries of one run before an infrastructure failure becomes a SandboxError."""
_BACKOFF_S = 0.2


class SandboxError(InfrastructureError):
    """The sandbox could not run a program (it never started, or was cut short from outside) in
    ``ATTEMPTS`` tries; the program's outcome is unknown."""


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
    infra_error: str | None = None
    """Why the sandbox itself failed to carry out the run (then nothing about the program is
    known); None when the program ran. ``Sandbox`` retries such runs and raises SandboxError
    when none succeeds, so callers see it only from ``_execute``."""

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
    if not os.path.exists(_PRLIMIT):
        raise SandboxUnavailable(f"no sandbox: the sandbox sets its process limit with {_PRLIMIT}, which this "
                                 "system lacks (install util-linux)")
    done = subprocess.run(_bwrap_command(_launcher(["/bin/true"], Limits(), True, 0), {}), capture_output=True, text=True,
                          preexec_fn=_preexec(Limits(), slot=0), env={}, timeout=30)
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
    killed), the rlimits but the process limit (see ``_launcher``), and (as root) a dedicated
    unprivileged user."""

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

    return setup


def _launcher(argv: list[str], limits: Limits, isolated: bool, slot: int) -> list[str]:
    """`argv` behind the run's first command: prlimit sets the process limit, then the shell
    writes the start marker on stderr and execs the program.

    Isolated, prlimit runs inside the new user namespace, so the limit counts that namespace's
    processes only (the kernel keeps RLIMIT_NPROC counts per user namespace since Linux 5.14);
    bubblewrap's own fork is not limited. Unisolated, the count is the uid's on the whole host,
    so the limit is what the uid already runs plus ``max_processes``."""
    nproc = limits.max_processes
    if not isolated:
        nproc += _tasks_of(_BASE_UID + slot if os.geteuid() == 0 else os.geteuid())
    return [_PRLIMIT, f"--nproc={nproc}:{nproc}", "--", "/bin/sh", "-c", f"printf '{_STARTED_PRINTF}' >&2 && exec \"$@\"",
            "rlvr-sandbox", *argv]


def _tasks_of(uid: int) -> int:
    """Processes and threads the uid runs now (what RLIMIT_NPROC counts on the host)."""
    count = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == uid:
                count += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:
            pass  # gone meanwhile
    return count


def _bwrap_command(argv: list[str], fds: dict[str, int], tmp_mb: int = Limits.tmp_mb,
                   mounts: tuple[Mount, ...] = (), cwd: str = "/tmp", env: dict[str, str] | None = None) -> list[str]:
    """bubblewrap around `argv`: see the module docstring; `fds` are memfds mounted read-only in
    /sandbox; `mounts` host folders bound in (`run_shell`), `cwd` and `env` the run's own."""
    cmd = [bwrap_path() or "bwrap", "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
           "--ro-bind", "/usr", "/usr", "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
           "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
           "--proc", "/proc", "--dev", "/dev", "--size", str(tmp_mb << 20), "--tmpfs", "/tmp",
           "--hostname", "sandbox", "--dir", "/sandbox"]
    for m in mounts:
        cmd += ["--bind" if m.writable else "--ro-bind", m.host, m.path]
    cmd += ["--chdir", cwd]
    for key, value in {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", **(env or {})}.items():
        cmd += ["--setenv", key, value]
    for name, fd in fds.items():
        cmd += ["--perms", "0444", "--ro-bind-data", str(fd), f"/sandbox/{name}"]
    # the root itself read-only (its own tmpfs, which the run's user owns): a run writes /tmp only.
    # Writable, a run could create /etc/ssl/openssl.cnf, /etc/ld.so.cache or /etc/localtime, which
    # a library loaded later in the run's other process reads (a red-team review made OpenSSL load
    # its own library into the unit-test judge that way, docs/LOG.md session 19)
    return cmd + ["--remount-ro", "/", "--", *argv]


@dataclass(frozen=True)
class Mount:
    """A host folder bound into an isolated run at `path` (`Sandbox.run_shell`)."""

    host: str
    path: str
    writable: bool = False

    def __post_init__(self) -> None:
        if not os.path.isabs(self.path) or os.path.normpath(self.path) in ("/", "/usr", "/proc", "/dev", "/sandbox"):
            raise ValueError(f"a sandbox mount goes at an absolute path of its own, not {self.path!r}")
        if not os.path.isdir(self.host):
            raise ValueError(f"a sandbox mount binds a folder; {self.host!r} is not one")


class Sandbox:
    """Runs Python programs or shell commands in isolation; thread-safe, one run per slot at a time."""

    def __init__(self, isolation: Isolation = "auto", limits: Limits | None = None) -> None:
        self.isolation = isolation
        self.limits = limits or Limits()

    def run_python(self, code: str, stdin: str | bytes = "", *, files: dict[str, str] | None = None,
                   limits: Limits | None = None, slot: int = 0, inherit: tuple[int, ...] = ()) -> Result:
        """Run `code` as /sandbox/main.py (`files` are put beside it, read-only). `inherit`: open
        file descriptors the program gets, by the same numbers (a file the run's own user could
        not open by its path, opened by rlvr; it reads it through the descriptor)."""
        return self._run([_RUNTIME_PYTHON, "-E", "-s", "-B", "/sandbox/main.py"], {"main.py": code, **(files or {})},
                         stdin, limits or self.limits, slot, inherit=inherit)

    def run_shell(self, command: str, stdin: str | bytes = "", *, files: dict[str, str] | None = None,
                  limits: Limits | None = None, slot: int = 0, mounts: tuple[Mount, ...] = (),
                  cwd: str | None = None, env: dict[str, str] | None = None, shell: str = "/bin/sh") -> Result:
        """Run `command` with `shell` -c (the runtime's tools only), files in /sandbox. `mounts` bind
        host folders in (a task's files that persist from one run to the next), `cwd` is where it
        runs (default /tmp) and `env` is added to its environment: isolated runs only, since an
        unisolated run could not put a folder at its path."""
        if (mounts or cwd or env) and check_isolation(self.isolation) != "bwrap":
            raise SandboxUnavailable("a run with mounted folders needs bubblewrap's isolation (sandbox.isolation = "
                                     "\"auto\" or \"bwrap\", and the bubblewrap package)")
        return self._run([shell, "-c", command], files or {}, stdin, limits or self.limits, slot, mounts, cwd, env)

    def _run(self, argv: list[str], files: dict[str, str], stdin: str | bytes, limits: Limits, slot: int,
             mounts: tuple[Mount, ...] = (), cwd: str | None = None, env: dict[str, str] | None = None,
             inherit: tuple[int, ...] = ()) -> Result:
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
                    fds[name] = fd
                cmd = _bwrap_command(_launcher(argv, limits, True, slot), fds, limits.tmp_mb, mounts, cwd or "/tmp",
                                     env)
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
                cmd = _launcher([a.replace("/sandbox/", workdir + "/") for a in argv], limits, False, slot)
                env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "LANG": "C.UTF-8"}
                cwd = workdir
            for attempt in range(ATTEMPTS):
                if attempt:
                    time.sleep(_BACKOFF_S * 2 ** (attempt - 1))
                for fd in fds.values():
                    os.lseek(fd, 0, os.SEEK_SET)  # bubblewrap reads each file from the shared offset
                result = _execute(cmd, stdin, limits, slot, fds, env, cwd, mode, inherit)
                if result.infra_error is None:
                    return result
            raise SandboxError(f"the sandbox could not run the program in {ATTEMPTS} attempts: {result.infra_error}")
        finally:
            for fd in fds.values():
                os.close(fd)
            if workdir:
                shutil.rmtree(workdir, ignore_errors=True)


def _execute(cmd: list[str], stdin: str | bytes, limits: Limits, slot: int, fds: dict[str, int],
             env: dict[str, str] | None, cwd: str | None, mode: str, inherit: tuple[int, ...] = ()) -> Result:
    """One attempt. ``infra_error`` is set when the launcher never wrote its start marker (the
    program never ran) or bubblewrap itself was killed by a signal rlvr did not send."""
    start = time.monotonic()
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                pass_fds=(*fds.values(), *inherit), env=env if env is not None else {}, cwd=cwd,
                                preexec_fn=_preexec(limits, slot))
    except OSError as exc:
        return Result(None, "", "", False, None, time.monotonic() - start, mode, f"could not start: {exc}")
    isolated = mode == "bwrap"
    overflow = threading.Event()
    stop = lambda: _kill_tree(proc, isolated)  # noqa: E731 - what a capture calls past its cap
    out = _Capture(proc.stdout, limits.output_bytes, overflow, stop)
    err = _Capture(proc.stderr, limits.output_bytes + len(_STARTED), overflow, stop)
    feeder = threading.Thread(target=_feed, args=(proc.stdin, stdin.encode() if isinstance(stdin, str) else stdin), daemon=True)
    for t in (out.thread, err.thread, feeder):
        t.start()
    timed_out = not _wait(proc, limits.timeout_s)
    if timed_out:
        timed_out = not overflow.is_set()
        _kill_tree(proc, isolated)
        proc.wait()
    for t in (out.thread, err.thread):
        t.join(timeout=5)
    duration = time.monotonic() - start
    code = proc.returncode
    raw = err.data()
    if not raw.startswith(_STARTED):
        why = raw.decode(errors="replace").strip()[-300:] or f"exit status {code}"
        return Result(code, "", "", timed_out, None, duration, mode, f"the program never started ({why})")
    if isolated and code < 0 and not (timed_out or overflow.is_set()):
        return Result(code, "", "", False, None, duration, mode,
                      f"bubblewrap was killed by signal {-code}, which rlvr did not send")
    stderr = raw[len(_STARTED):].decode(errors="replace")
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


def _wait(proc: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Wait for `proc` to exit, at most `timeout_s`; False if it is still running. A pidfd wakes
    up the moment it exits (Popen.wait's timeout polls with sleeps growing to 50 ms, which cost
    ~15 ms a run)."""
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # before Linux 5.3 or Python 3.9
        deadline = time.monotonic() + timeout_s
        while proc.poll() is None:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)
        return True
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
    finally:
        os.close(pidfd)
    if ready:
        proc.wait()
    return bool(ready)


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
    """Reads a pipe to its end, keeping at most `cap` bytes; past that, sets `overflow` and calls `stop`."""

    def __init__(self, pipe: IO[bytes] | None, cap: int, overflow: threading.Event, stop: Callable[[], None]) -> None:
        self.chunks: list[bytes] = []
        self.size, self.cap, self.overflow, self.stop = 0, cap, overflow, stop
        self.thread = threading.Thread(target=self._read, args=(pipe,), daemon=True)

    def _read(self, pipe: IO[bytes] | None) -> None:
        if pipe is None:
            return
        while chunk := pipe.read1(65536) if hasattr(pipe, "read1") else pipe.read(65536):
            room = self.cap - self.size
            if room > 0:
                self.chunks.append(chunk[:room])
            self.size += len(chunk)
            if self.size > self.cap and not self.overflow.is_set():
                self.overflow.set()
                self.stop()
        pipe.close()

    def data(self) -> bytes:
        return b"".join(self.chunks)

    def text(self) -> str:
        return self.data().decode(errors="replace")


class SandboxPool:
    """Runs many programs at once, at most `parallelism` at a time, each in its own slot (its own
    host user, so one run's process limit does not starve another's)."""

    def __init__(self, sandbox: Sandbox, parallelism: int = 4) -> None:
        if parallelism < 1:
            raise ValueError(f"parallelism must be >= 1, got {parallelism}")
        self.sandbox, self.parallelism = sandbox, parallelism
        self._free = list(range(parallelism))
        self._lock = threading.Lock()

    @overload
    def run_python(self, programs: list[tuple[str, str | bytes]], files: list[dict[str, str]] | None = None,
                   errors: Literal["raise"] = "raise") -> list[Result]: ...

    @overload
    def run_python(self, programs: list[tuple[str, str | bytes]], files: list[dict[str, str]] | None = None,
                   errors: Literal["return"] = ...) -> list[Result | SandboxError]: ...

    def run_python(self, programs: list[tuple[str, str | bytes]], files: list[dict[str, str]] | None = None,
                   errors: Literal["raise", "return"] = "raise") -> list[Result] | list[Result | SandboxError]:
        """Results of (code, stdin) pairs, in order. A run the sandbox could not carry out raises
        its SandboxError, or with ``errors="return"`` stands in the list in its result's place
        (so one such run does not cost the verdicts of the others)."""
        def program(i: int) -> Callable[[Sandbox, int], Result]:
            code, stdin = programs[i]
            return lambda sandbox, slot: sandbox.run_python(code, stdin, files=files[i] if files else None, slot=slot)

        return self.map([program(i) for i in range(len(programs))], errors)

    def map(self, runs: list[Callable[[Sandbox, int], Result]],
            errors: Literal["raise", "return"] = "raise") -> list[Result | SandboxError]:
        """Each run called with the pool's sandbox and a free slot (``lambda sandbox, slot:
        sandbox.run_shell(..., slot=slot)``), `parallelism` at a time; the results in order, a
        SandboxError raised or, with ``errors="return"``, in its run's place."""
        check_isolation(self.sandbox.isolation)  # fail once, clearly, before starting anything

        def one(run: Callable[[Sandbox, int], Result]) -> Result | SandboxError:
            with self._lock:
                slot = self._free.pop()
            try:
                return run(self.sandbox, slot)
            except SandboxError as err:
                if errors == "raise":
                    raise
                return err
            finally:
                with self._lock:
                    self._free.append(slot)

        with ThreadPoolExecutor(self.parallelism) as pool:
            return list(pool.map(one, runs))


_default: dict[str, SandboxPool] = {}


def configure(isolation: Isolation = "auto", limits: Limits | None = None, parallelism: int = 2) -> SandboxPool:
    """Set the sandbox pool that rewards use (`rlvr train` does this from the config's `sandbox` section)."""
    _default["pool"] = SandboxPool(Sandbox(isolation, limits), parallelism)
    return _default["pool"]


def default_pool() -> SandboxPool:
    """The configured pool, or one with the default settings."""
    return _default.get("pool") or configure()
