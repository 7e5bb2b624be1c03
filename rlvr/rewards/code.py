"""Code rewards: extract the program from a completion and run unit tests on it in the sandbox.

Two test formats, both read from the prompt's data row:

- MBPP style: ``tests``, a list of statements (usually ``assert f(1) == 2``), each one test;
  optional ``test_setup_code`` runs before them.
- HumanEval style: ``test``, source defining ``check(candidate)``, and ``entry_point``, the
  function's name; one test, ``check(<entry_point>)``. When the extracted code does not define
  the entry point (the model wrote only the body), the row's ``code_prompt`` (the function's
  signature and docstring) is put in front of it, as HumanEval's own harness does; when it does,
  the prompt's import lines are.

``mode = "all"`` scores 1 when every test passes, else 0; ``"fraction"`` scores the share that
passed. A completion without code, code that does not run, a timeout or a limit scores 0.

How a pass is recognised: the harness reads a random token on its standard input, runs the
solution and the tests, then prints the token with the counts. Exiting early (``sys.exit(0)``,
``os._exit(0)``) or printing a fake result line therefore scores 0. Code that deliberately reads
the harness's own memory to find the token could still forge a pass: the harness and the
solution share a process. Watch for reward hacking in ``samples.jsonl`` when training strong models.
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from rlvr.sandbox import default_pool

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
_PYTHON = {"", "python", "py", "python3"}


def extract_code(text: str) -> str | None:
    """The last fenced code block tagged python (or untagged); an unclosed last fence counts
    (a completion cut off by the token budget). None when the text has no fenced block."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON]
    return blocks[-1] if blocks else None


_HARNESS = '''import sys
def _run(token):
    namespace = {"__name__": "__solution__"}
    passed = 0
    try:
        exec(compile(SETUP + "\\n" + SOLUTION, "solution.py", "exec"), namespace)
    except BaseException:
        print(token, 0, len(TESTS), flush=True)
        return
    for source in TESTS:
        try:
            exec(compile(source, "test.py", "exec"), namespace)
            passed += 1
        except BaseException:
            pass
    print(token, passed, len(TESTS), flush=True)
_run(sys.stdin.readline().strip())
'''


def _program(solution: str, tests: list[str], setup: str) -> str:
    return f"SOLUTION = {solution!r}\nTESTS = {tests!r}\nSETUP = {setup!r}\n" + _HARNESS


def unit_tests_reward(prompt: str, completion: str, **row: Any) -> float:
    """One completion's score (see ``unit_tests_group_reward`` for the keywords and the module
    docstring for how a pass is recognised)."""
    return unit_tests_group_reward(prompt, [completion], **row)[0]


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
) -> list[float]:
    """``unit_tests_reward`` for a prompt's whole group at once: the programs run side by side in
    the sandbox pool (``sandbox.parallelism`` at a time). This is what the built-in
    ``unit_tests`` reward is."""
    if mode not in ("all", "fraction"):
        raise ValueError(f"unit_tests reward: mode must be 'all' or 'fraction', got {mode!r}")
    suite = _suite(tests, test, entry_point)
    runs: dict[int, tuple[str, str]] = {}
    for k, completion in enumerate(completions):
        code = extract_code(completion)
        if code is not None:
            runs[k] = (_program(_with_prompt(code, test, entry_point, code_prompt), suite, test_setup_code),
                       secrets.token_hex(16))
    scores = [0.0] * len(completions)
    if not runs:
        return scores
    results = default_pool().run_python([(program, token + "\n") for program, token in runs.values()])
    for (k, (_program_text, token)), result in zip(runs.items(), results):
        scores[k] = _verdict(result.stdout, token, len(suite), mode)
    return scores


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
    """HumanEval: the prompt's header in front of a bare body, or its imports in front of a whole function."""
    if test is None or not code_prompt or not entry_point:
        return code
    if not re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", code, re.M):
        return code_prompt + code
    imports = [line for line in code_prompt.splitlines() if line.startswith(("import ", "from "))]
    return "\n".join([*imports, code])


def _verdict(stdout: str, token: str, suite_size: int, mode: str) -> float:
    """The score from the harness's last line carrying this run's token (0 without one)."""
    for line in reversed(stdout.splitlines()):
        parts = line.split()
        if len(parts) == 3 and parts[0] == token:
            passed, total = int(parts[1]), int(parts[2])
            if total != suite_size:
                return 0.0
            return passed / total if mode == "fraction" else float(passed == total)
    return 0.0
