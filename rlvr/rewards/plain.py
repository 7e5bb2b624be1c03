"""Plain data across a process boundary: the only values the unit-test harness lets pass between
the model's code and the tests (rlvr.rewards.code_judge and code_server).

A plain value is None, bool, int, float, complex, str, bytes, or a list, tuple, dict, set or
frozenset of plain values, each of exactly that type: a subclass (an ``int`` whose ``__eq__``
always says True) is not plain. The encoding is a one-byte tag per value with lengths in front,
so a tuple stays a tuple, a dict may have any plain keys, ints of any size and floats (nan, inf
and -0.0 included) survive exactly. ``decode`` builds fresh builtin objects, runs no code of the
sender's, checks every length against the data and refuses nesting deeper than ``MAX_DEPTH``:
anything else raises ``NotPlain``.

This file is copied into the sandbox beside the judge and the server and imported there by the
system's ``python3``. It imports nothing: a sandbox run pays for every import (json's regular
expressions alone took 12 ms there).
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing costs 7-14 ms to import in each sandbox run; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 100
"""Deepest nesting accepted (deeper data is refused, not recursed into)."""
REQUEST_DEPTH = 2 * MAX_DEPTH
"""Deepest nesting of the unit-test harness's calls and their replies (rlvr.rewards.code_judge):
a test may pass back what the solution returned inside a few levels of its own, and a reply
carries a changed argument as deep as the call's."""


ENDS_EARLY = "a plain-data message ends early"


class NotPlain(TypeError):
    """A value (or an encoded message) that is not plain data."""


def encode(value: Any, max_depth: int = MAX_DEPTH) -> bytes:
    """``value`` as bytes; NotPlain if anything in it is not exactly a plain type or it nests
    deeper than ``max_depth``."""
    out: list[bytes] = []
    _put(value, out, 0, max_depth)
    return b"".join(out)


def decode(data: bytes, max_depth: int = MAX_DEPTH) -> Any:
    """The plain value that ``encode`` made; NotPlain for anything else."""
    value, end = _get(bytes(data), 0, 0, max_depth)
    if end != len(data):
        raise NotPlain("trailing bytes after a plain value")
    return value


def _sized(tag: bytes, payload: bytes, out: list[bytes]) -> None:
    out += [tag, len(payload).to_bytes(4, "big"), payload]


_CONTAINER_TAG: dict[type, bytes] = {list: b"L", tuple: b"T", set: b"E", frozenset: b"Z"}


def _put(v: Any, out: list[bytes], depth: int, limit: int) -> None:
    if depth > limit:
        raise NotPlain(f"nested deeper than {limit}")
    t = type(v)
    if v is None:
        out.append(b"N")
    elif t is bool:
        out.append(b"t" if v else b"f")
    elif t is int:
        _sized(b"I", v.to_bytes((v.bit_length() + 8) // 8, "big", signed=True), out)
    elif t is float:
        _sized(b"F", v.hex().encode(), out)
    elif t is complex:
        _sized(b"C", f"{v.real.hex()} {v.imag.hex()}".encode(), out)
    elif t is str:
        _sized(b"S", v.encode("utf-8", "surrogatepass"), out)
    elif t is bytes:
        _sized(b"Y", v, out)
    elif t in _CONTAINER_TAG:
        out += [_CONTAINER_TAG[t], len(v).to_bytes(4, "big")]
        for x in v:
            _put(x, out, depth + 1, limit)
    elif t is dict:
        out += [b"D", len(v).to_bytes(4, "big")]
        for k, x in v.items():
            _put(k, out, depth + 1, limit)
            _put(x, out, depth + 1, limit)
    else:
        raise NotPlain(f"a {t.__module__}.{t.__qualname__} is not plain data")


def _length(data: bytes, at: int) -> tuple[int, int]:
    if at + 4 > len(data):
        raise NotPlain(ENDS_EARLY)
    return int.from_bytes(data[at:at + 4], "big"), at + 4


def _get(data: bytes, at: int, depth: int, limit: int) -> tuple[Any, int]:
    if depth > limit:
        raise NotPlain(f"nested deeper than {limit}")
    if at >= len(data):
        raise NotPlain(ENDS_EARLY)
    tag = data[at:at + 1]
    at += 1
    if tag == b"N":
        return None, at
    if tag in (b"t", b"f"):
        return tag == b"t", at
    n, at = _length(data, at)
    if tag in (b"L", b"T", b"E", b"Z", b"D"):
        if n > len(data) - at:  # every item takes a byte at least: no allocation past the data
            raise NotPlain(ENDS_EARLY)
        items = []
        for _ in range(2 * n if tag == b"D" else n):
            item, at = _get(data, at, depth + 1, limit)
            items.append(item)
        try:
            if tag == b"D":
                return dict(zip(items[::2], items[1::2])), at
            return (items if tag == b"L" else (tuple, set, frozenset)[b"TEZ".index(tag)](items)), at
        except TypeError as err:  # an unhashable key or member
            raise NotPlain(str(err)) from None
    if n > len(data) - at:
        raise NotPlain(ENDS_EARLY)
    payload, at = data[at:at + n], at + n
    try:
        if tag == b"I":
            return int.from_bytes(payload, "big", signed=True), at
        if tag == b"F":
            return float.fromhex(payload.decode("ascii")), at
        if tag == b"C":
            real, imag = payload.decode("ascii").split(" ")
            return complex(float.fromhex(real), float.fromhex(imag)), at
        if tag == b"S":
            return payload.decode("utf-8", "surrogatepass"), at
        if tag == b"Y":
            return payload, at
    except (ValueError, UnicodeError, OverflowError) as err:
        raise NotPlain(f"malformed plain-data value ({err})") from None
    raise NotPlain(f"unknown plain-data tag {tag!r}")
