"""The solution's side of rlvr's unit-test harness: runs the model's code and answers the judge's
calls with plain data. It runs in the sandbox in its own process, forked by the judge
(rlvr.rewards.code_judge) before the judge has read anything secret: it holds no tests and no
token, and it closes the judge's stdin and stdout before it runs any model code.

Everything here is untrusted once the solution has run: the solution may replace any of it. The
judge therefore trusts nothing it receives beyond what rlvr.rewards.plain decodes.

Messages on two pipes (from the judge, to it) are length-prefixed plain data:
``("load", source)`` → ``("ok",)`` or ``("raise", type, message)``;
``("describe", names)`` → one entry per name: ``("callable",)``, ``("module", module name)``,
``("value", value)``, ``("missing",)`` or ``("unplain", type)``;
``("call", name, args, kwargs)`` → ``("return", value)``, ``("raise", type, message)`` or
``("unplain", type)``.
"""

from __future__ import annotations

import os
import sys
TYPE_CHECKING = False  # typing costs 7-14 ms to import in each sandbox run; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

import plain  # type: ignore[import-not-found]  # beside this file in the sandbox (rlvr/rewards/plain.py)


def _read(fd: int, n: int) -> bytes:
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send(fd: int, message: Any) -> None:
    data = plain.encode(message)
    data = len(data).to_bytes(8, "big") + data
    while data:
        data = data[os.write(fd, data):]


def _describe(namespace: dict[str, Any], name: str) -> tuple[Any, ...]:
    if name not in namespace:
        return ("missing",)
    obj = namespace[name]
    if isinstance(obj, type(os)):  # a module
        return ("module", obj.__name__)
    if callable(obj):
        return ("callable",)
    try:
        plain.encode(obj)
    except plain.NotPlain:
        return ("unplain", type(obj).__name__)
    return ("value", obj)


def _call(namespace: dict[str, Any], name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    try:
        value = namespace[name](*args, **kwargs)
    except BaseException as err:  # the solution's own failure (SystemExit included) is the judge's to see
        return ("raise", type(err).__name__, str(err)[:500])
    try:
        plain.encode(value)
    except plain.NotPlain:
        return ("unplain", type(value).__name__)
    return ("return", value)


def serve(requests: int, replies: int) -> None:
    """Answer the judge's requests until it closes its end. The caller has made fd 0 /dev/null
    and fd 1 stderr, so the solution's prints never reach the run's stdout."""
    namespace: dict[str, Any] = {"__name__": "__solution__"}
    while True:
        try:
            request = plain.decode(_read(requests, int.from_bytes(_read(requests, 8), "big")))
        except EOFError:
            return
        kind = request[0]
        if kind == "load":
            try:
                exec(compile(request[1], "solution.py", "exec"), namespace)
                reply: tuple[Any, ...] = ("ok",)
            except BaseException as err:
                reply = ("raise", type(err).__name__, str(err)[:500])
        elif kind == "describe":
            reply = tuple(_describe(namespace, name) for name in request[1])
        else:
            reply = _call(namespace, request[1], request[2], request[3])
        sys.stdout.flush()  # the solution's prints (to stderr: fd 1 is stderr here), before the reply
        _send(replies, reply)
