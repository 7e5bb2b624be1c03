"""The judge of rlvr's unit-test harness: runs the tests, never the model's code.

It runs in the sandbox as the program (``python3 main.py``) and reads one plain-data dict
(rlvr.rewards.plain) on stdin: ``token`` (a secret nonce for its verdict line), ``solution`` (the model's code with the task's
setup), ``trusted`` (code from the task, not the model: the test setup, HumanEval's prompt with
its helper functions), ``tests`` (statements, each one test) and ``bind`` (names that must come
from the solution even if trusted code defines them: HumanEval's entry point).

Then, in this order:

1. It forks the solution process (rlvr.rewards.code_server) before it reads anything: the child's
   memory holds no token and no test. The child makes fd 0 /dev/null and fd 1 stderr at once, so
   only the judge can read the job or write the run's stdout; it runs no model code until step 4.
   (A fork, not a fresh ``python3``: a second interpreter start cost a third of the run.)
2. It reads its stdin to the end.
3. It makes itself non-dumpable, so no other process of the sandbox's user can read or write its
   memory (``/proc/<pid>/mem``, ``ptrace``) or open its files and pipes through ``/proc``.
4. It runs the trusted code, sends the solution to the solution process to load, then binds the names the tests use that neither the trusted code
   nor the builtins define (and the ``bind`` names) to the solution's: a function becomes a
   proxy that sends its arguments as plain data and returns the plain-data result, a value is
   copied as plain data, a module is imported here by name from the standard library. A name
   the tests use resolves to trusted code first, the builtins second, the solution last.
5. It runs each test here, on the plain values, and prints ``<token> <passed> <total>``.

A pass is earned only by the tests' own assertions holding on plain builtin values: an object
that equals everything, replaced builtins, an early exit, a printed verdict or a look at the
tests cannot cross the process boundary. Two other verdict lines: ``<token> unjudgeable
<reason>`` (the task's own code fails here, or a test passes the solution something that is not
plain data) and ``<token> infra <reason>`` (the solution process could not be started).
"""

from __future__ import annotations

import builtins
import os
import sys
TYPE_CHECKING = False  # typing costs 7-14 ms to import in each sandbox run; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

import plain  # type: ignore[import-not-found]  # beside this file in the sandbox (rlvr/rewards/plain.py)
import server  # type: ignore[import-not-found]  # beside it too (rlvr/rewards/code_server.py)

MAX_MESSAGE = 64 << 20
_MODULES = getattr(sys, "stdlib_module_names", None)  # Python >= 3.10


class SolutionError(Exception):
    """The solution raised an exception that is not a builtin one, or broke the protocol."""


class Unjudgeable(BaseException):
    """The task cannot be judged by this harness (not the solution's fault); BaseException so a
    test's own ``except Exception`` does not swallow it."""


def _no_dumps() -> None:
    import ctypes

    pr_set_dumpable = 4
    if ctypes.CDLL(None, use_errno=True).prctl(pr_set_dumpable, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0) failed")


class Solution:
    """The solution process and the calls to it."""

    def __init__(self) -> None:
        requests, self._out = os.pipe()
        self._in, replies = os.pipe()
        null = os.open(os.devnull, os.O_RDONLY)
        self.pid = os.fork()
        if self.pid == 0:  # the solution's process: see the module docstring, step 1
            try:
                os.dup2(null, 0)
                os.dup2(2, 1)
                for fd in (null, self._out, self._in):
                    os.close(fd)
                server.serve(requests, replies)
            finally:
                os._exit(0)
        for fd in (requests, replies, null):
            os.close(fd)
        self.alive = True

    def request(self, message: Any) -> Any:
        if not self.alive:
            raise SolutionError("the solution's process has ended")
        data = plain.encode(message)  # raises NotPlain for a test's non-plain argument
        data = len(data).to_bytes(8, "big") + data
        try:
            while data:
                data = data[os.write(self._out, data):]
            size = int.from_bytes(self._read(8), "big")
            if size > MAX_MESSAGE:
                raise SolutionError(f"a reply of {size} bytes")
            reply = plain.decode(self._read(size))
        except (OSError, EOFError, SolutionError, plain.NotPlain):
            self.close()
            raise SolutionError("the solution's process ended or broke the protocol") from None
        if type(reply) is not tuple or not reply:
            self.close()
            raise SolutionError("the solution's process broke the protocol")
        return reply

    def _read(self, n: int) -> bytes:
        chunks = []
        while n:
            chunk = os.read(self._in, min(n, 1 << 20))
            if not chunk:
                raise EOFError
            chunks.append(chunk)
            n -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        if self.alive:
            self.alive = False
            try:
                os.kill(self.pid, 9)  # SIGKILL; the signal module costs 6 ms to import
            except OSError:
                pass
            os.waitpid(self.pid, 0)


def _raise(reply: tuple[Any, ...]) -> Any:
    """The solution's exception, as the builtin of that name where there is one."""
    if len(reply) == 3 and reply[0] == "raise" and type(reply[1]) is str and type(reply[2]) is str:
        cls = getattr(builtins, reply[1], None)
        if isinstance(cls, type) and issubclass(cls, Exception):
            raise cls(reply[2])
        raise SolutionError(f"{reply[1]}: {reply[2]}")
    if len(reply) == 2 and reply[0] == "unplain":
        raise SolutionError(f"returned a {reply[1]!s}, which is not plain data")
    raise SolutionError("the solution's process broke the protocol")


def _proxy(solution: Solution, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            reply = solution.request(("call", name, list(args), kwargs))
        except plain.NotPlain as err:
            raise Unjudgeable(f"a test passes {name}() something that is not plain data ({err})") from None
        if len(reply) == 2 and reply[0] == "return":
            return reply[1]
        return _raise(reply)

    call.__name__ = call.__qualname__ = name
    return call


def _names(code: Any) -> set[str]:
    """Every name a compiled test refers to (globals and attributes alike; extra names are harmless)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _bind(solution: Solution, namespace: dict[str, Any], tests: list[Any], bind: list[str]) -> None:
    wanted = set().union(*(_names(t) for t in tests)) if tests else set()
    wanted = {n for n in wanted if n not in namespace and not hasattr(builtins, n)} | set(bind)
    for name in bind:
        namespace.pop(name, None)  # a trusted stub (HumanEval's signature and docstring) never stands in
    order = sorted(wanted)
    kinds = solution.request(("describe", order))
    if len(kinds) != len(order):
        raise SolutionError("the solution's process broke the protocol")
    for name, kind in zip(order, kinds):
        if type(kind) is not tuple or not kind:
            continue
        if kind[0] == "callable":
            namespace[name] = _proxy(solution, name)
        elif kind[0] == "value" and len(kind) == 2:
            namespace[name] = kind[1]
        elif kind[0] == "module" and len(kind) == 2 and type(kind[1]) is str:
            top = kind[1].partition(".")[0]
            if _MODULES is None or top in _MODULES:
                try:
                    namespace[name] = __import__(kind[1], fromlist=["_"])
                except Exception:  # not importable here: the name stays unbound
                    pass


def _verdict(token: str, *words: object) -> None:
    sys.stdout.write(" ".join([token, *map(str, words)]) + "\n")
    sys.stdout.flush()


def main() -> None:
    try:
        solution: Solution | OSError = Solution()
    except OSError as err:
        solution = err
    job = plain.decode(sys.stdin.buffer.read())
    token = job["token"]
    _no_dumps()
    if isinstance(solution, OSError):
        _verdict(token, "infra", f"could not start the solution's process: {solution}")
        return
    try:
        namespace: dict[str, Any] = {"__name__": "__main__"}
        try:
            exec(compile(job["trusted"], "trusted.py", "exec"), namespace)
            tests = [compile(source, "test.py", "exec") for source in job["tests"]]
        except BaseException as err:
            _verdict(token, "unjudgeable", f"the task's own code fails: {type(err).__name__}: {err}")
            return
        loaded = solution.request(("load", job["solution"]))
        passed = 0
        if loaded == ("ok",):
            _bind(solution, namespace, tests, job["bind"])
            for test in tests:
                try:
                    exec(test, namespace)
                    passed += 1
                except Unjudgeable as err:
                    _verdict(token, "unjudgeable", err)
                    return
                except BaseException:  # a failed assertion, or anything else: this test failed
                    pass
        _verdict(token, passed, len(tests))
    except SolutionError:
        _verdict(token, 0, len(job["tests"]))
    finally:
        solution.close()


if __name__ == "__main__":
    main()
