"""The sandbox against escape and abuse attempts: each is contained, classified, and the host unaffected."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from rlvr import sandbox as sb
from rlvr.cli import main
from rlvr.sandbox import Limits, Sandbox, SandboxPool, SandboxUnavailable

pytestmark = pytest.mark.dtype_independent

FAST = Limits(timeout_s=4, cpu_s=2, memory_mb=256, output_bytes=1 << 16)
box = Sandbox("auto", FAST)


def run(code: str, stdin: str = "") -> sb.Result:
    return box.run_python(code, stdin)


def test_a_normal_program_runs_with_stdin_and_files() -> None:
    r = box.run_python("import helper, sys; print(helper.double(sys.stdin.read().strip()))", "21",
                       files={"helper.py": "def double(x): return 2 * int(x)"})
    assert r.ok and r.stdout == "42\n" and r.isolation == "bwrap"
    assert r.killed_by_limit is None and not r.timed_out


def test_no_network_not_even_the_hosts_loopback() -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    try:
        r = run(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)")
        assert r.exit_code == 1 and "ConnectionRefusedError" in r.stderr  # its own, empty loopback
        r = run("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)")
        assert r.exit_code == 1 and "Network is unreachable" in r.stderr
    finally:
        server.close()


def test_no_host_files_and_no_environment_secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "credentials"
    secret.write_text("hunter2")
    monkeypatch.setenv("RLVR_TEST_SECRET", "hunter2")
    for path in (str(secret), "/root", "/etc/passwd", os.getcwd(), str(Path.home())):
        r = run(f"print(open({path!r}).read())" if path == str(secret) else f"import os; print(os.listdir({path!r}))")
        assert r.exit_code == 1 and "No such file or directory" in r.stderr, path
        assert "hunter2" not in r.stdout
    r = run("import os, json; print(json.dumps(dict(os.environ)))")
    assert json.loads(r.stdout) == {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PWD": "/tmp"}


def test_writes_stay_inside_and_are_discarded(tmp_path: Path) -> None:
    r = run("open('/usr/pwned', 'w').write('x')")
    assert r.exit_code == 1 and "Read-only file system" in r.stderr
    marker = tmp_path / "pwned"
    r = run(f"import os\nos.makedirs({str(tmp_path)!r}, exist_ok=True)\nopen({str(marker)!r}, 'w').write('x')\n"
            "open('/tmp/pwned', 'w').write('x')\nprint('wrote')")
    assert r.ok and r.stdout == "wrote\n"  # into the sandbox's own root and /tmp...
    assert not marker.exists() and not Path("/tmp/pwned").exists()  # ...which the host never sees
    assert "FileNotFoundError" in run("open('/tmp/pwned').read()").stderr  # and the next run neither


def test_fork_bomb_is_capped_and_killed_with_its_whole_tree() -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    r = run(bomb)
    assert r.timed_out and r.exit_code is not None and r.exit_code != 0
    assert _leftover_processes() == []


def test_memory_bomb_hits_the_memory_limit() -> None:
    r = run("x = bytearray(1 << 34)")
    assert r.killed_by_limit == "memory" and "MemoryError" in r.stderr


def test_infinite_loop_hits_the_cpu_limit_and_sleeping_hits_the_timeout() -> None:
    # a wall-clock limit far above the CPU one, so that a busy machine cannot make it fire first
    r = box.run_python("while True:\n    pass", limits=Limits(timeout_s=60, cpu_s=1, memory_mb=256))
    assert r.killed_by_limit == "cpu" and not r.timed_out
    r = run("import subprocess, time\nsubprocess.Popen(['sleep', '1000'])\ntime.sleep(1000)")
    assert r.timed_out and r.killed_by_limit is None
    assert _leftover_processes() == []  # the child sleeping in the background went too


def test_enormous_output_is_capped() -> None:
    r = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)")
    assert r.killed_by_limit == "output" and len(r.stdout) == FAST.output_bytes


def test_huge_files_hit_the_file_size_limit() -> None:
    r = run("open('/tmp/big', 'wb').write(b'x' * (40 << 20))")
    assert r.killed_by_limit == "file_size"


def test_signalling_the_parent_reaches_nothing_on_the_host() -> None:
    bystander = subprocess.Popen(["sleep", "60"])
    try:
        r = run(f"import os, signal\nprint(os.getppid())\nfor pid in (1, {os.getpid()}, {bystander.pid}, -1):\n"
                "    try:\n        os.kill(pid, signal.SIGKILL)\n    except OSError as e:\n        print(type(e).__name__)")
        assert r.stdout.splitlines()[0] == "1"  # its parent is the namespace's init, not rlvr
        assert bystander.poll() is None  # the host process and this test are still alive
    finally:
        bystander.kill()
        bystander.wait()


def test_pool_runs_programs_concurrently_in_order() -> None:
    pool = SandboxPool(box, parallelism=3)
    results = pool.run_python([(f"print({i} * {i})", "") for i in range(7)])
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(7)]


def test_unavailable_isolation_refuses_and_says_how_to_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sb, "bwrap_path", lambda: None)
    monkeypatch.setattr(sb, "_checked", {})
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap.*isolation = \"none\""):
        Sandbox("auto").run_python("print(1)")


def test_opting_out_warns_on_every_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_TEST_SECRET", "hunter2")
    unisolated = Sandbox("none", FAST)
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="unisolated"):
            r = unisolated.run_python("import os; print(sorted(os.environ))")
        assert r.ok and r.isolation == "none" and "RLVR_TEST_SECRET" not in r.stdout
    with pytest.warns(RuntimeWarning):
        assert unisolated.run_python("x = bytearray(1 << 34)").killed_by_limit == "memory"  # limits still apply


def test_cli_prints_the_json_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prog, given = tmp_path / "prog.py", tmp_path / "in.txt"
    prog.write_text("import sys; print(sys.stdin.read()[::-1])")
    given.write_text("abc")
    assert main(["sandbox", "run", str(prog), "--stdin", str(given), "--timeout", "5"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["stdout"] == "cba\n" and result["exit_code"] == 0 and result["timed_out"] is False
    assert {"stderr", "killed_by_limit", "duration_s"} <= result.keys()
    prog.write_text("import time; time.sleep(30)")
    assert main(["sandbox", "run", str(prog), "--timeout", "1"]) == 1
    assert json.loads(capsys.readouterr().out)["timed_out"] is True


def _leftover_processes() -> list[str]:
    """Live (non-zombie) processes of the sandbox users, shortly after a run."""
    threading.Event().wait(0.2)
    out = subprocess.run(["ps", "-eo", "uid=,stat=,args="], capture_output=True, text=True).stdout
    return [line for line in out.splitlines()
            if line.split() and int(line.split()[0]) >= 60000 and not line.split()[1].startswith("Z")]


def test_shell_commands_run_isolated_too() -> None:
    r = box.run_shell("cat /sandbox/notes.txt; ls /; (getent hosts example.com || echo no-dns) 2>&1",
                      files={"notes.txt": "hello from the host"})
    assert r.ok and r.stdout.startswith("hello from the host")
    assert "root" not in r.stdout.split() and "home" not in r.stdout.split() and "no-dns" in r.stdout


def test_open_files_are_limited() -> None:
    r = run("handles = [open('/tmp/f%d' % i, 'w') for i in range(500)]")
    assert r.exit_code == 1 and "Too many open files" in r.stderr


@contextmanager
def processes_of_the_sandbox_user(n: int) -> Iterator[None]:
    """`n` sleeping processes of the uid slot 0 runs as (60000 as root, else this user): the
    processes of earlier runs that have not gone yet, or of another rlvr process beside this one."""
    def become() -> None:
        if os.geteuid() == 0:
            os.setgid(60000)
            os.setuid(60000)

    sleepers = [subprocess.Popen(["sleep", "60"], preexec_fn=become) for _ in range(n)]
    try:
        yield
    finally:
        for p in sleepers:
            p.kill()
            p.wait()


def test_other_processes_of_the_sandbox_user_do_not_use_up_a_runs_process_limit() -> None:
    """The root cause of correct programs scored 0 under load: RLIMIT_NPROC set on the host
    counted every process of the uid, so runs failed to start (EAGAIN) while other processes of
    it were around. The limit is now the run's own: set inside its user namespace."""
    forks = "import os\nfor _ in range(4):\n    if os.fork() == 0:\n        os._exit(0)\n    os.wait()\nprint('ok')"
    with processes_of_the_sandbox_user(FAST.max_processes + 8):
        results = SandboxPool(box, parallelism=4).run_python([(forks, "")] * 8)
    assert [(r.exit_code, r.stdout, r.infra_error) for r in results] == [(0, "ok\n", None)] * 8


def test_a_fork_bomb_beside_a_run_does_not_starve_it() -> None:
    """Two pools (two rlvr processes) use slot 0's uid at once: one run fills its process limit,
    the other's runs still start and finish."""
    bomb = ("import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(60)\n"
            "    except OSError:\n        time.sleep(0.01)")
    bombing = threading.Thread(target=lambda: Sandbox("auto", Limits(timeout_s=6, cpu_s=5)).run_python(bomb))
    bombing.start()
    try:
        threading.Event().wait(1.0)  # the bomb is at its limit by now
        results = [box.run_python("print(6 * 7)") for _ in range(5)]
    finally:
        bombing.join()
    assert [r.stdout for r in results] == ["42\n"] * 5
    assert _leftover_processes() == []


def test_a_run_that_never_starts_is_retried_then_raised_never_a_result(monkeypatch: pytest.MonkeyPatch) -> None:
    sb.check_isolation("auto")
    calls: list[int] = []
    real = sb._execute

    def flaky(cmd: list[str], *args: object) -> sb.Result:
        calls.append(1)
        if len(calls) < fail_first:  # the first attempts cannot start (as bwrap's fork under EAGAIN)
            cmd = [c.replace(sb._PRLIMIT, "/usr/bin/no-such-prlimit") for c in cmd]
        return real(cmd, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(sb, "_execute", flaky)
    monkeypatch.setattr(sb, "_BACKOFF_S", 0.01)
    fail_first = sb.ATTEMPTS  # all but the last attempt fail: the run still succeeds
    r = box.run_python("print('hi')")
    assert r.ok and r.stdout == "hi\n" and len(calls) == sb.ATTEMPTS
    calls.clear()
    fail_first = sb.ATTEMPTS + 1  # every attempt fails: an error saying why, not a failed program
    with pytest.raises(sb.SandboxError, match="never started.*no-such-prlimit"):
        box.run_python("print('hi')")
    assert len(calls) == sb.ATTEMPTS
    fail_first = 10**9
    results = SandboxPool(box, 2).run_python([("print(1)", "")] * 2, errors="return")
    assert all(isinstance(r, sb.SandboxError) for r in results)


@pytest.mark.parametrize("program", [
    "import sys\nsys.stderr.write(\"bwrap: Can't fork for pid 1: Resource temporarily unavailable\\n\")\nsys.exit(1)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    "import os, signal\nos.kill(1, signal.SIGKILL)\nraise SystemExit(3)",  # the namespace's init ignores it
])
def test_a_program_cannot_pass_its_own_failure_off_as_the_sandboxs(program: str) -> None:
    r = run(program)
    assert r.infra_error is None and not r.ok and r.exit_code in (1, 128 + 9, 3)


def test_cli_says_when_the_sandbox_could_not_run_the_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    prog = tmp_path / "prog.py"
    prog.write_text("print(1)")
    sb.check_isolation("auto")
    monkeypatch.setattr(sb, "_PRLIMIT", "/usr/bin/no-such-prlimit")
    monkeypatch.setattr(sb, "_BACKOFF_S", 0.01)
    assert main(["sandbox", "run", str(prog)]) == 2  # no JSON result: nothing is known about the program
    out = capsys.readouterr()
    assert out.out == "" and "could not run the program in 3 attempts" in out.err


def test_a_mounted_folder_persists_between_runs_and_nothing_else_is_writable() -> None:
    """rlvr.agents.harbor's workdir: a host folder bound at a path of its own, writable or not."""
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp())  # under /tmp: pytest's own folders are closed to the sandbox's user
    try:
        _mounted(root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _mounted(root: Path) -> None:
    work, tests = root / "work", root / "tests"
    work.mkdir()
    tests.mkdir()
    os.chmod(root, 0o755)
    os.chmod(work, 0o777)  # the sandbox's own user (uid 60000 + slot under root) writes it
    (tests / "t.sh").write_text("echo from-tests\n")
    box = Sandbox()
    mounts = (sb.Mount(str(work), "/app", writable=True), sb.Mount(str(tests), "/tests"))
    r = box.run_shell("echo hi > note.txt; pwd; echo $GREETING; bash /tests/t.sh; echo x > /tests/y || echo tests-ro; "
                      "mkdir /logs 2>/dev/null || echo root-ro", mounts=mounts, cwd="/app", env={"GREETING": "hello"},
                      shell="/bin/bash")
    assert r.ok and r.stdout.split() == ["/app", "hello", "from-tests", "tests-ro", "root-ro"], r
    assert (work / "note.txt").read_text() == "hi\n" and not (tests / "y").exists()
    again = box.run_shell("cat /app/note.txt", mounts=mounts[:1])
    assert again.stdout == "hi\n"
    for bad in ("/", "/usr", "relative"):
        with pytest.raises(ValueError, match="absolute path of its own"):
            sb.Mount(str(work), bad)
    with pytest.raises(SandboxUnavailable, match="mounted folders need"):
        Sandbox(isolation="none").run_shell("true", mounts=mounts)
