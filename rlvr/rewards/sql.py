"""Text-to-SQL rewards: run the model's query and the gold query on the task's SQLite database
and compare what they return (execution accuracy, as Spider, arXiv:1809.08887, and BIRD,
arXiv:2305.03111, score), in rlvr's sandbox.

A data row names its database one of three ways: ``db``, a SQLite file; ``db_id`` with the
reward's ``db_dir`` kwarg, Spider's and BIRD's layout (``{db_dir}/{db_id}/{db_id}.sqlite``); or
``schema``, SQL that builds it (CREATE and INSERT statements), run afresh for each query. The
gold query is the row's ``query`` (Spider), ``SQL`` (BIRD) or ``answer``.

The model's query is the last fenced code block of its completion (```sql, or untagged), else
its last ``<answer>`` tag; none scores 0. The two result sets are compared, column order kept,
per ``compare``: "auto" (the default) as lists when the gold query has an ORDER BY, else as
multisets (Spider's rule); "set" ignores duplicates (BIRD's); "multiset"; "list". Floats compare
to 12 significant digits.

The threat model: the query is hostile. It runs in the sandbox (rlvr.sandbox) on a read-only
database under an authorizer that allows reading only (rlvr.rewards.sql_judge): a write, ATTACH,
PRAGMA, a second statement or extension loading is an error (0); a query past ``timeout_s``, or
one that returns more than ``max_rows`` rows or makes an over-long string, scores 0. A gold query
that fails, or a database that does not open, is the task's fault: a ValueError that names the
row. A gold query past its time, or a run the sandbox could not carry out, is an
InfrastructureError: excluded from the update, never a 0.

Partial credit. Execution accuracy is sparse; Reasoning-SQL (Pourreza et al., "Reasoning-SQL:
Reinforcement Learning with SQL Tailored Partial Rewards for Reasoning-Enhanced Text-to-SQL",
arXiv:2503.23157) adds rewards for a query that runs, for the schema it uses and for its n-grams.
Here the score is ``correct·match + executes·ran + schema_linking·S + ngram·N``, with ``correct = 1`` and
the other weights 0 by default, and every part is reported beside the score
(``sql/executed``, ``sql/schema_linking``, ``sql/ngram``) whatever the weights:

- ran: 1 when the query executed without error (paid whether or not its rows match, as the
  authors' code pays its syntax reward);
- S: the Jaccard similarity of the (table, column) pairs the two queries read, as SQLite itself
  resolves them while preparing each statement (so aliases, ``*`` and implicit tables resolve
  exactly, with no SQL parser). Jaccard, not recall: with recall, a ``SELECT *`` over a join of
  every table would earn full schema credit;
- N: the Jaccard similarity of the two queries' token bigrams (keywords and names lower-cased).

Reasoning-SQL's sum is ``correct = 3, executes = 1, schema_linking = 1, ngram = 1`` (its LLM judge is not
built in: add ``llm_judge`` beside this reward). Partial credit is text similarity too: a policy
can earn N and S without being right, so keep ``correct`` the largest weight.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from rlvr.errors import InfrastructureError
from rlvr.rewards.extract import extract_fenced
from rlvr.rewards.styles import with_info
from rlvr.sandbox import Mount, Result, Sandbox, SandboxError, check_isolation, default_pool

_JUDGE = (Path(__file__).parent / "sql_judge.py").read_text()
_ORDER_BY = re.compile(r"\border\s+by\b", re.I)
_COMPARES = ("auto", "list", "multiset", "set")


def extract_sql(text: str) -> str | None:
    """The last ```sql (or untagged) fenced block's content, else the last <answer> tag's; an
    unclosed last fence counts (a completion cut off by its token budget). None without one."""
    query = extract_fenced(text, ("sql", "sqlite", ""))
    return query.strip() if query else None


def gold_query(fields: dict[str, Any]) -> str:
    for key in ("query", "SQL", "answer"):
        if isinstance(fields.get(key), str) and fields[key].strip():
            return str(fields[key]).strip()
    raise ValueError("sql reward: the row needs its gold query in 'query' (Spider), 'SQL' (BIRD) or 'answer'")


def database(fields: dict[str, Any], db_dir: str | None) -> tuple[str | None, str | None]:
    """(the database file, or None; the script that builds it, or None) for a row."""
    if fields.get("db"):
        path = os.path.abspath(os.path.expanduser(str(fields["db"])))
    elif fields.get("db_id") and db_dir:
        path = os.path.abspath(os.path.join(os.path.expanduser(db_dir), str(fields["db_id"]), f"{fields['db_id']}.sqlite"))
    elif isinstance(fields.get("schema"), str):
        return None, fields["schema"]
    else:
        raise ValueError("sql reward: the row needs 'db' (a SQLite file), 'db_id' with the reward's kwargs "
                         "db_dir (Spider's and BIRD's layout), or 'schema' (SQL that builds the database)")
    if not os.path.isfile(path):
        raise ValueError(f"sql reward: no database file at {path}")
    return path, None


def _reachable(path: str) -> bool:
    """Whether any user may read ``path`` by its name: the file readable, every folder above it
    searchable, by others (the sandbox's run runs as a user of its own when rlvr runs as root)."""
    if os.geteuid() != 0:
        return True  # the run is rlvr's own user
    parts = Path(path).parents
    return bool(os.stat(path).st_mode & stat.S_IROTH) and all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)


def _run(job: dict[str, Any], path: str | None) -> Any:
    """The sandbox run of one job. A database file is bound read-only at /db by its folder; one
    the run's user could not reach by its path (under a private home) is opened here and read
    through the descriptor into the judge's memory (so it must fit the sandbox's memory limit)."""
    def run(sandbox: Sandbox, slot: int) -> Result:
        # time for the two queries and the start; the configured limits (memory) otherwise
        limits = dataclasses.replace(sandbox.limits, timeout_s=2 * job["timeout_s"] + 10,
                                     cpu_s=int(2 * job["timeout_s"]) + 10)
        if path is None or check_isolation(sandbox.isolation) == "none":
            return sandbox.run_python(_JUDGE, json.dumps({**job, "db": path}), slot=slot, limits=limits)
        if not _reachable(path):
            fd = os.open(path, os.O_RDONLY)
            try:
                return sandbox.run_python(_JUDGE, json.dumps({**job, "db_fd": fd}), slot=slot, inherit=(fd,),
                                          limits=limits)
            finally:
                os.close(fd)
        mount = Mount(os.path.dirname(path), "/db")
        return sandbox.run_shell("exec /usr/bin/python3 -E -s -B /sandbox/main.py",
                                 json.dumps({**job, "db": "/db/" + os.path.basename(path)}),
                                 files={"main.py": _JUDGE}, mounts=(mount,), slot=slot, limits=limits)
    return run


_TOKEN = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|[A-Za-z_][A-Za-z0-9_$]*|\d+(?:\.\d+)?|\S")


def ngram_similarity(a: str, b: str, n: int = 2) -> float:
    """The Jaccard similarity of two queries' sets of token n-grams (quoted strings whole, the
    rest lower-cased); 1 when both are shorter than n tokens and equal."""
    def grams(query: str) -> set[tuple[str, ...]]:
        tokens = [t if t[0] in "'\"" else t.lower() for t in _TOKEN.findall(query.strip().rstrip(";"))]
        return {tuple(tokens[i : i + n]) for i in range(len(tokens) - n + 1)} or {tuple(tokens)}
    x, y = grams(a), grams(b)
    return len(x & y) / len(x | y)


def sql_group_reward(
    prompt: str, completions: list[str], *, db_dir: str | None = None, compare: str = "auto",
    timeout_s: float = 5.0, max_rows: int = 100_000, correct: float = 1.0, executes: float = 0.0,
    schema_linking: float = 0.0, ngram: float = 0.0, **row: Any,
) -> list[Any]:
    """Each completion's ``correct·match + executes·ran + schema_linking·S + ngram·N`` (the module
    docstring), with the parts beside it."""
    if compare not in _COMPARES:
        raise ValueError(f"sql reward: compare must be one of {', '.join(_COMPARES)}, got {compare!r}")
    gold = gold_query(row)
    path, script = database(row, db_dir)
    weights = {"match": correct, "executed": executes, "schema_linking": schema_linking, "ngram": ngram}
    how = ("list" if _ORDER_BY.search(gold) else "multiset") if compare == "auto" else compare
    queries = [extract_sql(c) for c in completions]
    asked = [k for k, q in enumerate(queries) if q is not None]
    nothing = {"executed": 0.0, "schema_linking": 0.0, "ngram": 0.0}
    scores: list[Any] = [with_info(0.0, nothing) for _ in completions]
    if not asked:
        return scores
    jobs = [{"script": script, "gold": gold, "predicted": queries[k], "compare": how, "timeout_s": timeout_s,
             "max_rows": max_rows} for k in asked]
    results = default_pool().map([_run(job, path) for job in jobs], errors="return")
    for k, result in zip(asked, results):
        parts = _verdict(result, row)
        if isinstance(parts, InfrastructureError):
            scores[k] = parts
            continue
        parts["ngram"] = ngram_similarity(str(queries[k]), gold)
        scores[k] = with_info(sum(weights[key] * parts[key] for key in weights),
                              {key: parts[key] for key in ("executed", "schema_linking", "ngram")})
    return scores


def _verdict(result: Result | SandboxError, row: dict[str, Any]) -> dict[str, float] | InfrastructureError:
    """The judge's parts of the score (match, executed, schema), or why there are none."""
    if isinstance(result, SandboxError):
        return result
    try:
        verdict = json.loads(result.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        if "@gold-done" in result.stdout:  # the model's query took the sandbox's time or memory
            return {"match": 0.0, "executed": 0.0, "schema_linking": 0.0}
        limit = f", stopped by its {result.killed_by_limit} limit" if result.killed_by_limit else \
            ", past its time" if result.timed_out else ""
        return InfrastructureError(f"sql reward: the judge stopped before the gold query's result (exit "
                                   f"{result.exit_code}{limit}; a database read into memory must fit "
                                   f"sandbox.memory_mb): {result.stderr[-300:]}")
    if verdict["gold"] == "timeout":
        return InfrastructureError("sql reward: the gold query ran past timeout_s; raise it, or check the machine's load")
    if verdict["gold"] != "ok":
        where = row.get("db_id") or row.get("db") or "the row's schema"
        raise ValueError(f"sql reward: the gold query fails on {where}: {verdict['gold']}")
    return {"match": float(verdict["match"]), "executed": float(verdict["predicted"] == "ok"),
            "schema_linking": float(verdict["schema"])}


# rlvr train checks the sandbox before it trains when a reward runs code (rlvr.train.setup)
sql_group_reward.runs_code = True  # type: ignore[attr-defined]
