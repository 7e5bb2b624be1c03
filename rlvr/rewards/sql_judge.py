"""The SQL reward's judge: runs the gold query and the model's query on one SQLite database and
compares their results (rlvr.rewards.sql). Standard library only: it runs in the sandbox as the
program, on the distribution's python3.

It reads one JSON object on stdin: ``db`` (the database file's path, opened read-only and
immutable), ``db_fd`` (a descriptor of the file, read into memory: rlvr opened it for a run whose
user cannot reach its path) or ``script`` (SQL that builds it in memory), ``gold`` and ``predicted`` (one statement
each), ``compare`` ("list", "multiset" or "set"), ``timeout_s`` (each query's time) and
``max_rows``; and prints ``@gold-done`` once the gold query has run, then one JSON line: ``{"gold": "ok" | <why it failed>, "predicted": "ok" |
"error: ..." | "timeout" | "too many rows", "match": bool, "schema": float}``. ``schema`` is the
Jaccard similarity of the (table, column) pairs the two queries read, as SQLite itself resolves
them (its authorizer is told of each column a statement reads when it is prepared); 1 when
neither reads a column, 0 when the model's query does not compile.

The model's query is data here, never Python: SQLite runs it under an authorizer that allows only
reading (SELECT, reads, functions, recursive CTEs), so ATTACH, PRAGMA, writes, temporary tables
and extension loading are refused, and a connection runs one statement. A progress handler stops
a query past its time, and SQLite's own limits cap a string or blob (``zeroblob(1e9)``) and the
rows fetched; the sandbox's limits cap the rest.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
import time
import urllib.parse
from collections import Counter

TYPE_CHECKING = False  # typing costs milliseconds to import in each sandbox run; mypy reads this as True
if TYPE_CHECKING:
    from typing import Any

_ALLOWED = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
_REFUSED_FUNCTIONS = {"load_extension", "readfile", "writefile", "edit", "fts3_tokenizer"}
MAX_LENGTH = 1 << 20
"""The longest string or blob a query may make (SQLITE_LIMIT_LENGTH), in bytes."""


class _Timeout(Exception):
    pass


_READS: set[tuple[str, str]] = set()
"""The (table, column) pairs the statement being prepared reads."""


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    if action == sqlite3.SQLITE_READ:
        _READS.add(((arg1 or "").lower(), (arg2 or "").lower()))
    if action not in _ALLOWED:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _REFUSED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


def _normal(value: object) -> object:
    """A float to 12 significant digits (two forms of one average, SUM(x)/COUNT(x) and AVG(x),
    may differ in the last of a double's ~16 digits); anything else as it is."""
    return float(f"{value:.12g}") if isinstance(value, float) else value


def _rows(conn: sqlite3.Connection, query: str, timeout_s: float, max_rows: int) -> list[tuple[object, ...]]:
    deadline = time.monotonic() + timeout_s

    def check() -> int:
        return 1 if time.monotonic() > deadline else 0

    conn.set_progress_handler(check, 1000)
    _READS.clear()
    try:
        cursor = conn.execute(query)
        if cursor.description is None:  # "", ";", a comment, REINDEX: a statement, but no query
            raise sqlite3.ProgrammingError("not a query: it returns no columns")
        rows = cursor.fetchmany(max_rows + 1)
    except sqlite3.OperationalError as err:
        if "interrupted" in str(err) and time.monotonic() > deadline:
            raise _Timeout() from None
        raise
    if len(rows) > max_rows:
        raise OverflowError(f"more than {max_rows} rows")
    return [tuple(_normal(v) for v in row) for row in rows]


def _same(gold: list[tuple[object, ...]], got: list[tuple[object, ...]], compare: str) -> bool:
    if compare == "list":
        return gold == got
    if compare == "set":
        return set(gold) == set(got)
    return Counter(gold) == Counter(got)


def _jaccard(a: set[tuple[str, str]], b: set[tuple[str, str]]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def judge(job: dict[str, Any]) -> dict[str, object]:
    if job.get("db_fd") is not None:
        fd = int(job["db_fd"])
        data = bytearray()
        while chunk := os.pread(fd, 1 << 20, len(data)):
            data += chunk
        conn = sqlite3.connect(":memory:", cached_statements=0)
        conn.deserialize(bytes(data))
    elif job.get("db"):
        uri = "file:" + urllib.parse.quote(str(job["db"])) + "?mode=ro&immutable=1"
        conn = sqlite3.connect(uri, uri=True, cached_statements=0)
    else:
        conn = sqlite3.connect(":memory:", cached_statements=0)
        try:
            conn.executescript(str(job.get("script") or ""))
        except sqlite3.Error as err:
            return {"gold": f"the database script fails: {err}", "predicted": "", "match": False}
    conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, MAX_LENGTH)
    conn.set_authorizer(_authorize)
    timeout_s, max_rows = float(job["timeout_s"]), int(job["max_rows"])
    try:
        gold = _rows(conn, str(job["gold"]), timeout_s, max_rows)
    except _Timeout:
        return {"gold": "timeout", "predicted": "", "match": False}
    except (sqlite3.Error, OverflowError, ValueError) as err:
        return {"gold": f"{type(err).__name__}: {err}", "predicted": "", "match": False}
    gold_reads = set(_READS)
    print("@gold-done", flush=True)  # what stops the run from here on is the model's query
    out: dict[str, object] = {"gold": "ok", "match": False}
    try:
        got = _rows(conn, str(job["predicted"]), timeout_s, max_rows)
        out.update(predicted="ok", match=_same(gold, got, str(job["compare"])))
    except _Timeout:
        out["predicted"] = "timeout"
    except OverflowError:
        out["predicted"] = "too many rows"
    except (sqlite3.Error, ValueError, MemoryError) as err:  # ValueError: a NUL in the query
        out["predicted"] = f"error: {type(err).__name__}: {str(err)[:200]}"
    # a query refused or failing at prepare time read nothing of the schema: its reads are partial
    out["schema"] = _jaccard(gold_reads, set(_READS)) if out["predicted"] in ("ok", "timeout", "too many rows") else 0.0
    return out


if __name__ == "__main__":
    print(json.dumps(judge(json.loads(sys.stdin.read()))))
