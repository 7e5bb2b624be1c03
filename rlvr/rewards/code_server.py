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
``("call", name, args, kwargs)`` → ``("return", value, changed args, changed kwargs)``,
``("raise", type, message, args)`` or ``("unplain", type)``.

What a correct solution gives is sent as it would compare in one process, where that is plain
data: a subclass of a plain type (a ``Counter``, ``OrderedDict`` or ``defaultdict``, a named
tuple, an ``IntEnum``) as that type (`_plainly`: its value, not its methods, so an ``int`` whose
``__eq__`` always says True arrives as the number it holds); a generator or ``map`` as the list
of what it yields (so a test comparing it with a list passes, where in one process it would
not); an exception under the nearest builtin class it derives from (a ``class
Invalid(ValueError)`` as ``ValueError``) with its arguments; and a list, dict or set argument
the call changed (an in-place sort) with its new contents, which the judge writes into the
test's own object.
"""

from __future__ import annotations

import builtins
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
    data = plain.encode(message, plain.REQUEST_DEPTH)
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
    value = _sendable(obj)
    return ("unplain", type(obj).__name__) if value is _UNPLAIN else ("value", value)


_UNPLAIN = object()
_BASES = (dict, list, tuple, set, frozenset, str, bytes, int, float, complex)
"""The plain types a subclass is sent as (bool has no subclasses); the first it derives from."""
_ITERATORS = (type(x for x in ""), map, filter, zip, enumerate, reversed)
"""One-pass iterators a solution may return, sent as the list of what they yield."""
MUTABLE = (list, dict, set)
"""The argument types whose changes a call sends back."""
ARGS_BYTES = 4096
"""An exception's arguments are sent up to this size encoded (its message is cut at 500 characters)."""


def _plainly(value: Any, depth: int = 0) -> Any:
    """``value`` with every subclass of a plain type in it made that type, its contents read with
    the base type's own methods (the subclass's overrides never run); anything else as it is."""
    if depth > plain.MAX_DEPTH:
        return value
    t = type(value)
    if t is bool or value is None:
        return value
    if isinstance(value, _ITERATORS):  # `return map(...)`: what list() or sorted() in a test would read
        return [_plainly(x, depth + 1) for x in value]
    base = next((b for b in _BASES if isinstance(value, b)), None)
    if base is None:
        return value
    if base is dict:
        return {_plainly(k, depth + 1): _plainly(v, depth + 1) for k, v in dict.items(value)}
    if base in (list, tuple, set, frozenset):
        return base(_plainly(x, depth + 1) for x in base.__iter__(value))
    if t is base:
        return value
    if base is str:
        return str.__str__(value)
    if base is bytes:
        return bytes(memoryview(value))
    if base is int:
        return int.__int__(value)
    if base is float:
        return float.__float__(value)
    return complex(complex.real.__get__(value), complex.imag.__get__(value))


def _sendable(value: Any, depth: int = plain.MAX_DEPTH) -> Any:
    """``value`` if it is plain data, else `_plainly`'s copy if that is, else `_UNPLAIN`."""
    try:
        plain.encode(value, depth)
        return value
    except Exception:  # noqa: BLE001 - not plain (NotPlain, or nesting Python cannot recurse into)
        pass
    try:
        copy = _plainly(value)
        plain.encode(copy, depth)
        return copy
    except Exception:  # noqa: BLE001 - an unhashable key once plain, a subclass's broken iteration
        return _UNPLAIN


def _builtin_class(cls: type) -> str:
    """The name of the nearest builtin class `cls` derives from (itself if it is one)."""
    for base in cls.__mro__:
        if getattr(builtins, base.__name__, None) is base:
            return base.__name__
    return cls.__name__


def _raised(err: BaseException) -> tuple[Any, ...]:
    args = _sendable(err.args)
    if args is _UNPLAIN or len(plain.encode(args)) > ARGS_BYTES:
        args = None
    try:
        message = str(err)[:500]
    except BaseException:  # an exception whose __str__ raises
        message = ""
    return ("raise", _builtin_class(type(err)), message, args)


def _call(namespace: dict[str, Any], name: str, args: list[Any], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    # the plain arguments a call may change in place, as they came: sent back if they changed
    given: list[tuple[int | str, Any]] = [*enumerate(args), *kwargs.items()]
    before = {key: plain.encode(arg, plain.REQUEST_DEPTH) for key, arg in given if type(arg) in MUTABLE}
    try:
        value = namespace[name](*args, **kwargs)
    except BaseException as err:  # the solution's own failure (SystemExit included) is the judge's to see
        return _raised(err)
    changed_args: dict[int, Any] = {}
    changed_kwargs: dict[str, Any] = {}
    for key, encoded in before.items():
        arg = args[key] if isinstance(key, int) else kwargs[key]
        now = _sendable(arg, plain.REQUEST_DEPTH)
        if now is _UNPLAIN:  # the call put something not plain into it
            return ("unplain", f"{type(arg).__name__} argument")
        if plain.encode(now, plain.REQUEST_DEPTH) != encoded:
            if isinstance(key, int):
                changed_args[key] = now
            else:
                changed_kwargs[key] = now
    sent = _sendable(value)
    if sent is _UNPLAIN:
        return ("unplain", type(value).__name__)
    return ("return", sent, changed_args, changed_kwargs)


def serve(requests: int, replies: int) -> None:
    """Answer the judge's requests until it closes its end. The caller has made fd 0 /dev/null
    and fd 1 stderr, so the solution's prints never reach the run's stdout."""
    namespace: dict[str, Any] = {"__name__": "__solution__"}
    while True:
        try:
            request = plain.decode(_read(requests, int.from_bytes(_read(requests, 8), "big")), plain.REQUEST_DEPTH)
        except EOFError:
            return
        kind = request[0]
        if kind == "load":
            try:
                exec(compile(request[1], "solution.py", "exec"), namespace)
                reply: tuple[Any, ...] = ("ok",)
            except BaseException as err:
                reply = _raised(err)
        elif kind == "describe":
            reply = tuple(_describe(namespace, name) for name in request[1])
        else:
            reply = _call(namespace, request[1], request[2], request[3])
        sys.stdout.flush()  # the solution's prints (to stderr: fd 1 is stderr here), before the reply
        _send(replies, reply)
