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
   proxy that sends its arguments as plain data and returns the plain-data result (and writes
   back what the call changed in a list, dict or set argument), a value is copied as plain data,
   a module is the judge's own of that name where the judge has imported it already or it is
   one of a few standard-library modules that only define things (`_module`). A name the tests
   use resolves to trusted code first, the builtins second, the solution last.
5. It runs each test here, on the plain values, and prints ``<token> <passed> <total>`` after
   each (so a later test that runs out of time fails alone); the last such line is the verdict.

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
_PURE = frozenset({
    "array", "bisect", "calendar", "cmath", "collections", "copy", "dataclasses", "datetime", "decimal",
    "enum", "fractions", "functools", "heapq", "itertools", "json", "math", "numbers",
    "operator", "random", "re", "statistics", "string", "struct", "textwrap", "time", "typing",
    "unicodedata"})
"""Standard-library modules whose import only defines things: a test may use one the solution
imported (MBPP's ``math.isclose`` without an import of its own), which the judge imports itself."""
# the judge's own directory, where plain.py and server.py came from, leaves the import path: only
# the standard library answers an import from here on (a trusted test's ``import math`` included)
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]


BROKE_PROTOCOL = "the solution's process broke the protocol"


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
        # raises NotPlain for a test's non-plain argument; a solution that returns 99 levels must not
        # make `decode(encode(x))` an error of the task (plain.REQUEST_DEPTH)
        data = plain.encode(message, plain.REQUEST_DEPTH)
        data = len(data).to_bytes(8, "big") + data
        try:
            while data:
                data = data[os.write(self._out, data):]
            size = int.from_bytes(self._read(8), "big")
            if size > MAX_MESSAGE:
                raise SolutionError(f"a reply of {size} bytes")
            reply = plain.decode(self._read(size), plain.REQUEST_DEPTH)
        except (OSError, EOFError, SolutionError, plain.NotPlain):
            self.close()
            raise SolutionError("the solution's process ended or broke the protocol") from None
        if type(reply) is not tuple or not reply:
            self.close()
            raise SolutionError(BROKE_PROTOCOL)
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
    """The solution's exception, as the builtin of that name where there is one (the nearest
    builtin class of the solution's own: rlvr.rewards.code_server), made from its arguments where
    that gives its message, else from the message."""
    if len(reply) in (3, 4) and reply[0] == "raise" and type(reply[1]) is str and type(reply[2]) is str:
        cls = getattr(builtins, reply[1], None)
        if cls in (StopIteration, StopAsyncIteration):  # would end a test's map() or all() quietly
            raise RuntimeError(f"the solution raised {reply[1]}")  # as a generator's does (PEP 479)
        if isinstance(cls, type) and issubclass(cls, Exception):
            err = None
            if len(reply) == 4 and type(reply[3]) is tuple:
                try:
                    err = cls(*reply[3])
                    if str(err)[:500] != reply[2]:  # a subclass's own message: the message it is
                        err = None
                except Exception:  # noqa: BLE001 - arguments this class refuses
                    err = None
            raise err if err is not None else cls(reply[2])
        raise SolutionError(f"{reply[1]}: {reply[2]}")
    if len(reply) == 2 and reply[0] == "unplain":
        raise SolutionError(f"returned a {reply[1]!s}, which is not plain data")
    raise SolutionError(BROKE_PROTOCOL)


def _changed(given: Any, now: Any) -> None:
    """Write a call's change to a list, dict or set argument into the test's own object."""
    if type(given) is not type(now) or type(given) not in (list, dict, set):
        raise SolutionError(BROKE_PROTOCOL)
    if type(given) is list:
        given[:] = now
    else:
        given.clear()
        given.update(now)


def _proxy(solution: Solution, name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            reply = solution.request(("call", name, list(args), kwargs))
        except plain.NotPlain as err:
            raise Unjudgeable(f"a test passes {name}() something that is not plain data ({err})") from None
        if len(reply) == 4 and reply[0] == "return" and type(reply[2]) is dict and type(reply[3]) is dict:
            for key, now in reply[2].items():
                if type(key) is not int or not 0 <= key < len(args):
                    raise SolutionError(BROKE_PROTOCOL)
                _changed(args[key], now)
            for key, now in reply[3].items():
                if key not in kwargs:
                    raise SolutionError(BROKE_PROTOCOL)
                _changed(kwargs[key], now)
            return reply[1]
        return _raise(reply)

    call.__name__ = call.__qualname__ = name
    return call


def _module(name: str) -> Any:
    """The judge's own module `name` for a test name the solution bound to a module: one the judge
    has imported already (importing it runs nothing) or one of `_PURE`, else None. Never a module
    the solution names and the judge would import afresh: importing runs its code, and a module
    such as ``unittest.__main__`` runs tests it finds in the working directory, which the
    solution's process can write."""
    if any(part.startswith("_") or not part.isidentifier() for part in name.split(".")):
        return None
    if name in sys.modules:
        return sys.modules[name]
    if name not in _PURE:
        return None
    try:
        return __import__(name)
    except Exception:  # noqa: BLE001 - not importable here: the name stays unbound
        return None


def _absent(name: str) -> Any:
    def call(*args: Any, **kwargs: Any) -> Any:
        raise NameError(f"the solution defines no {name}")

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
    if not order:  # the tests use only the task's own names and the builtins: any solution would pass
        raise Unjudgeable("the tests use no name a solution defines (only the task's own and the builtins)")
    kinds = solution.request(("describe", order))
    if len(kinds) != len(order):
        raise SolutionError(BROKE_PROTOCOL)
    for name, kind in zip(order, kinds):
        if type(kind) is not tuple or not kind:
            continue
        if kind[0] == "callable":
            namespace[name] = _proxy(solution, name)
        elif kind[0] == "value" and len(kind) == 2:
            namespace[name] = kind[1]
        elif kind[0] == "module" and len(kind) == 2 and type(kind[1]) is str:
            module = _module(kind[1])
            if module is not None:
                namespace[name] = module
    for name in bind:  # an entry point the solution did not give (or said was missing) is no builtin's
        namespace.setdefault(name, _absent(name))


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
            try:
                _bind(solution, namespace, tests, job["bind"])
            except Unjudgeable as err:
                _verdict(token, "unjudgeable", err)
                return
            for done, test in enumerate(tests, 1):
                try:
                    exec(test, namespace)
                    passed += 1
                except Unjudgeable as err:
                    _verdict(token, "unjudgeable", err)
                    return
                except BaseException:  # a failed assertion, or anything else: this test failed
                    pass
                if done < len(tests):  # so far: a later test that runs out of time fails alone
                    _verdict(token, passed, len(tests))
        _verdict(token, passed, len(tests))
    except SolutionError:
        _verdict(token, 0, len(job["tests"]))
    finally:
        solution.close()


if __name__ == "__main__":
    main()
