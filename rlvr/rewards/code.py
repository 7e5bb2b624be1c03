"""Code rewards: extract the program from a completion and run unit tests on it in the sandbox.

Two test formats, both read from the prompt's data row:

- MBPP style: ``tests``, a list of statements (usually ``assert f(1) == 2``), each one test;
  optional ``test_setup_code`` runs before them, and an optional ``entry_point`` names the
  function that must be the solution's (a name the tests use resolves to the builtins before the
  solution, so a task whose function is called ``pow`` or ``max`` needs it: without it the tests
  would call the builtin).
- HumanEval style: ``test``, source defining ``check(candidate)``, and ``entry_point``, the
  function's name; one test, ``check(<entry_point>)``. When the extracted code does not define
  the entry point (the model wrote only the body), the row's ``code_prompt`` (the function's
  signature and docstring) is put in front of it, as HumanEval's own harness does; when it does,
  the prompt still is (its imports and helper functions; the model's def replaces the stub).

``mode = "all"`` scores 1 when every test passes, else 0; ``"fraction"`` scores the share that
passed (a test that runs out of time or memory fails with the tests after it, those before it
keep their passes). A completion without code, or code that does not run, scores 0. A run
the sandbox could not carry out is not a 0: that completion's value is an InfrastructureError
(counted as ``unit_tests/error`` and excluded from the update).

The threat model: the policy writes arbitrary Python and will find any way to score without
solving. The model's code and the tests run in two processes of one sandbox run
(rlvr.rewards.code_judge, whose docstring gives the design): the tests, the task's own code and
the verdict live in the judge, which never runs model code, and only plain data (numbers,
strings, bytes, lists, tuples, dicts, sets, None, bool; exact types, no subclasses) crosses from
the model's process. So an object that equals everything, replaced builtins or redefined
helpers, exiting early, printing a verdict, reading the tests or the judge's memory, or
signalling the judge all fail (tests/test_code_exploits.py tries each). What remains possible:
code that special-cases the visible inputs of weak tests (a test suite's own coverage is the
limit), a solution correct only on the tested inputs, and, as with any sandbox, an escape through
a kernel or bubblewrap vulnerability. Watch ``samples.jsonl`` when training strong models.

What a correct solution does crosses as it would compare in one process: a ``Counter``, an
``OrderedDict`` or a named tuple arrives as the dict or tuple it holds, an exception of the
solution's own class as the nearest builtin it derives from (``except ValueError`` catches a
``class Invalid(ValueError)``) with its arguments, and a change to a list, dict or set argument
(an in-place sort) is written into the test's own object. A test that passes the solution a
value that is not plain (a function, an object) cannot be judged this way: it is reported as an
error of the task, never scored. A test that checks an argument's identity, or a change inside
a tuple argument, sees only the copy.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path
from collections.abc import Collection
from typing import Any

from rlvr.errors import InfrastructureError
from rlvr.rewards import plain
from rlvr.rewards.extract import fenced_blocks
from rlvr.sandbox import SandboxError, default_pool

_PYTHON = {"", "python", "py", "python3"}


def extract_code(text: str, names: Collection[str] = ()) -> str | None:
    """The last fenced code block that defines (``def``, ``class``) one of `names` (the names the
    tests use), a python-tagged one before an untagged one; where none does, the last tagged
    python block, else the last untagged one (so a ```python solution followed by a bare ```
    block of its output, or by a block of example calls, is the solution). An unclosed last
    fence counts (a completion cut off by the token budget). None when the text has no fenced
    block."""
    blocks = [(lang, body) for lang, body in fenced_blocks(text) if lang in _PYTHON]
    tagged = [body for lang, body in blocks if lang]
    for candidates in (tagged, [body for _, body in blocks]):  # python-tagged first, then any
        defining = [body for body in candidates if _defines(body, names)]
        if defining:
            return defining[-1]
    chosen = tagged or [body for _, body in blocks]
    return chosen[-1] if chosen else None


def _defines(code: str, names: Collection[str]) -> bool:
    return any(re.search(rf"^\s*(?:(?:async\s+)?def|class)\s+{re.escape(name)}\b", code, re.M) for name in names)


def _tested_names(suite: list[str], entry_point: str | None) -> set[str]:
    """The names the tests refer to (and the entry point): those a solution's block may define."""
    names = {entry_point} if entry_point else set()
    for test in suite:
        try:
            code = compile(test, "test.py", "exec")
        except SyntaxError:
            continue
        names |= set(code.co_names)
    return names


_HERE = Path(__file__).parent
_FILES = {"server.py": (_HERE / "code_server.py").read_text(), "plain.py": (_HERE / "plain.py").read_text()}
_JUDGE = (_HERE / "code_judge.py").read_text()


def _job(token: str, solution: str, tests: list[str], setup: str, trusted: str, bind: list[str]) -> bytes:
    """The judge's stdin (rlvr.rewards.code_judge)."""
    return plain.encode({"token": token, "solution": setup + "\n" + solution, "trusted": setup + "\n" + trusted,
                         "tests": tests, "bind": bind})


def unit_tests_reward(prompt: str, completion: str, **row: Any) -> float:
    """One completion's score (see ``unit_tests_group_reward`` for the keywords and the module
    docstring for how a pass is recognised); InfrastructureError when the sandbox could not run it."""
    (score,) = unit_tests_group_reward(prompt, [completion], **row)
    if isinstance(score, InfrastructureError):
        raise score
    return score


def unit_tests_group_reward(
    prompt: str,
    completions: list[str],
    *,
    tests: list[str] | None = None,
    test: str | None = None,
    entry_point: str | None = None,
    code_prompt: str | None = None,
    test_setup_code: str = "",
    mode: str = "all",
    **_: Any,
) -> list[float | InfrastructureError]:
    """``unit_tests_reward`` for a prompt's whole group at once: the programs run side by side in
    the sandbox pool (``sandbox.parallelism`` at a time). This is what the built-in
    ``unit_tests`` reward is."""
    if mode not in ("all", "fraction"):
        raise ValueError(f"unit_tests reward: mode must be 'all' or 'fraction', got {mode!r}")
    suite = _suite(tests, test, entry_point)
    trusted, bind = _trusted(test, entry_point, code_prompt)
    runs: dict[int, tuple[bytes, str]] = {}  # completion index -> (the judge's stdin, its token)
    names = _tested_names(suite, entry_point)
    for k, completion in enumerate(completions):
        code = extract_code(completion, names)
        if code is not None:
            token = secrets.token_hex(16)
            runs[k] = (_job(token, _with_prompt(code, test, entry_point, code_prompt), suite, test_setup_code,
                            trusted, bind), token)
    scores: list[float | InfrastructureError] = [0.0] * len(completions)
    if not runs:
        return scores
    results = default_pool().run_python([(_JUDGE, stdin) for stdin, _ in runs.values()], [_FILES] * len(runs),
                                        errors="return")
    for (k, (_stdin, token)), result in zip(runs.items(), results):
        scores[k] = result if isinstance(result, SandboxError) else _verdict(result.stdout, token, len(suite), mode)
    return scores


def _trusted(test: str | None, entry_point: str | None, code_prompt: str | None) -> tuple[str, list[str]]:
    """The task's own code the judge runs before the tests, and the names only the solution may
    define. HumanEval: the prompt (imports and helper functions such as ``poly``, which a test
    may call: the model's redefinition of one must not count), with the entry point bound to the
    model's; a prompt that does not compile contributes its import lines."""
    if test is None:  # MBPP style: an entry point named beside the tests is still the solution's
        return "", [entry_point] if entry_point else []
    if not entry_point:
        return "", []
    prompt = code_prompt or ""
    try:
        compile(prompt, "prompt.py", "exec")
    except SyntaxError:
        prompt = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
    return prompt, [entry_point]


def _suite(tests: list[str] | None, test: str | None, entry_point: str | None) -> list[str]:
    if tests is None and test is None:
        raise ValueError("unit_tests reward: the data row needs 'tests' (a list of asserts) or 'test' and "
                         "'entry_point' (HumanEval's check function)")
    if test is not None:
        if not entry_point:
            raise ValueError("unit_tests reward: a HumanEval-style 'test' needs the row's 'entry_point'")
        return [test + f"\ncheck({entry_point})\n"]
    if isinstance(tests, str) or not tests:
        raise ValueError(f"unit_tests reward: 'tests' must be a non-empty list of statements, got {tests!r}")
    return list(tests)


def _with_prompt(code: str, test: str | None, entry_point: str | None, code_prompt: str | None) -> str:
    """HumanEval: the prompt in front of a bare body; in front of a whole function too (its
    imports and helper functions; the function's own def replaces the prompt's stub), unless the
    prompt does not compile on its own, when only its import lines go in front."""
    if test is None or not code_prompt or not entry_point:
        return code
    if not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        return code_prompt + code
    try:
        compile(code_prompt, "prompt.py", "exec")
        return code_prompt + "\n" + code
    except SyntaxError:
        imports = [line for line in code_prompt.splitlines() if line.startswith(("import ", "from "))]
        return "\n".join([*imports, code])


def _verdict(stdout: str, token: str, suite_size: int, mode: str) -> float | InfrastructureError:
    """The score from the judge's line carrying this run's token (0 without one: the run died)."""
    for line in reversed(stdout.splitlines()):
        parts = line.split(maxsplit=2)
        if len(parts) < 2 or parts[0] != token:
            continue
        if parts[1] == "infra":
            return InfrastructureError(f"unit_tests: {parts[2] if len(parts) > 2 else 'the judge failed'}")
        if parts[1] == "unjudgeable":
            raise ValueError(f"unit_tests: this task cannot be judged: {parts[2] if len(parts) > 2 else ''}")
        passed, total = int(parts[1]), int(parts[2])
        if total != suite_size:
            return 0.0
        return passed / total if mode == "fraction" else float(passed == total)
    return 0.0


# rlvr train checks the sandbox before it trains when a reward runs code (rlvr.train.setup.setup):
# a machine without one would otherwise learn so at the first completion with code in it, hours in
unit_tests_reward.runs_code = True  # type: ignore[attr-defined]
unit_tests_group_reward.runs_code = True  # type: ignore[attr-defined]
