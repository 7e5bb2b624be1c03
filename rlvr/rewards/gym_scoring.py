"""reasoning-gym's own scorers, run where a completion cannot take over the trainer, hang it, or
score without solving.

A red-team review (docs/LOG.md, session 19) of reasoning-gym 0.1.25's ``score_answer`` found:

- it runs the answer as Python: ``eval(answer)`` (binary_matrix, spiral_matrix, string_insertion,
  n_queens) or sympy's ``parse_expr``, which calls ``eval`` with the builtins at hand (puzzle24,
  countdown, simple_integration, intermediate_integration, polynomial_multiplication), so an
  ``<answer>`` holding ``__import__('os').system(...)`` ran in the trainer;
- it can compute for ever: ``9**9**9`` as puzzle24's answer;
- it pays for work sympy does: ``integrate(<the integrand from the prompt>, X)`` scored 1 on the
  integration tasks, ``expand(<the product>)`` on polynomial_multiplication, and
  ``ord('¤') + 0*(…)`` reached countdown's target without its digits;
- puzzle24 never checks that the four numbers are the puzzle's: ``1*2*3*4`` solved every puzzle;
- complex_arithmetic scores ``nan`` 1.0 (``min(1.0, exp(-nan))`` is 1.0), so no answer naming
  nan or inf reaches a scorer unless the gold answer names one too.

So `score` first refuses, with 0.0, an answer that those tasks' scorers would evaluate and that is
not what a solution looks like (`refused`: arithmetic of the puzzle's own numbers; an
expression in the task's variables and the usual functions, with small exponents; a Python
literal where a scorer evaluates one). The rest is scored in a process of its own (`GymScorer`),
killed after `TIMEOUT_S` (the answer's failure: 0.0), and a score that is not a finite number
counts 0. What stays upstream's design: 33 tasks use reasoning-gym's default scorer, which pays
``len(gold) / len(answer)`` when the gold text appears anywhere in the answer, so listing
candidates earns about what guessing does (``0123456789`` earns 0.1 on a one-digit gcd).
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import math
import os
import pickle
import re
import select
import subprocess
import sys
import threading
import weakref
from typing import Any

from rlvr.errors import InfrastructureError

log = logging.getLogger(__name__)

TIMEOUT_S = 10.0
"""The longest one answer may be scored for; past it the scoring process is killed and the answer
scores 0.0 (a scorer answers in milliseconds; only a pathological answer takes seconds)."""

_ARITHMETIC = {"puzzle24", "countdown"}
_SYMBOLIC = {"simple_integration", "intermediate_integration", "polynomial_multiplication"}
_LITERAL = {"binary_matrix", "spiral_matrix", "string_insertion", "n_queens"}
_FUNCTIONS = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan", "sinh", "cosh", "tanh",
                        "exp", "log", "ln", "sqrt", "pi", "E"})
"""Names an expression answer may use besides the task's variables and the constant C."""
_MAX_EXPONENT = 1000
_MAX_LITERAL = 10**6
_NAME = re.compile(r"[A-Za-z_]\w*")
_NOT_A_NUMBER = re.compile(r"(?<![A-Za-z])(nan|inf|infinity)(?![A-Za-z])", re.I)
_NUMERIC = re.compile(r"[-+]?[\d.]+(?:[eE][-+]?\d+)?(?:\s*[-+]\s*[\d.]*(?:[eE][-+]?\d+)?\s*[ij])?|[-+]?[\d.]*\s*[ij]")
"""A gold answer that is a number, real or complex ("48.0 + 36.0i")."""
_OPERATORS = frozenset({"Integral", "integrate", "Derivative", "diff", "expand", "simplify", "factor", "Sum",
                        "summation", "Product", "solve", "limit", "Limit", "series", "Subs", "Function"})
"""Sympy names a gold answer may hold (a degenerate integration gold: "Integral(...)") that would
let an answer have sympy do the work: never allowed from the gold."""
_TOWER = re.compile(r"(\*\*|\^)[^+\-*/]*(\*\*|\^)")  # an exponent whose own exponent is unseparated


def tidied(answer: str, gold: str) -> str:
    """`answer` with what only its typography gets wrong put right, where the gold answer does not
    have it: a Unicode minus (U+2212) before a digit as ``-``, and the full stop after an answer
    that is just a number (``-14282.``). reasoning-gym's scorers compare strings or ``float()``
    them, and scored both 0."""
    if "\u2212" not in gold:
        answer = re.sub("\u2212\\s*(?=\\d)", "-", answer)
    if not gold.rstrip().endswith(".") and re.fullmatch(r"\s*[-+]?\d+(\.\d+)?\s*\.\s*", answer):
        answer = answer.rstrip().removesuffix(".").rstrip()
    return answer


def refused(task: str, answer: str, entry: dict[str, Any]) -> str | None:
    """Why `answer` must score 0.0 without reaching `task`'s scorer, or None to score it."""
    gold = str(entry.get("answer", ""))
    if _NOT_A_NUMBER.search(answer) and not _NOT_A_NUMBER.search(gold):
        return "nan or inf, which the gold answer is not"
    if _NUMERIC.fullmatch(gold.strip()) and re.search(r"nan|inf", answer, re.I):  # "1+nanj" parses as nan too
        return "nan or inf in a numeric answer"
    if task in _ARITHMETIC:
        if not re.fullmatch(r"[\d\s+\-*/()]+", answer) or "**" in answer or "//" in answer:
            return "only + - * / and parentheses on the given numbers"
        numbers = [int(n) for n in re.findall(r"\d+", answer)]
        if task == "puzzle24" and sorted(numbers) != sorted(int(n) for n in entry["metadata"]["numbers"]):
            return "not the puzzle's four numbers, each once"
        if any(n > _MAX_LITERAL for n in numbers):
            return "a number far beyond the puzzle's"
    elif task in _SYMBOLIC:
        allowed = {*_FUNCTIONS, "C", *(set(_NAME.findall(gold)) - _OPERATORS)}
        variable = entry.get("metadata", {}).get("variable")
        if variable:
            allowed.add(str(variable))
        if not re.fullmatch(r"[\w\s+\-*/^().]+", answer) or "__" in answer:
            return "an expression of numbers, variables and + - * / ^ ( )"
        names = set(_NAME.findall(answer)) - allowed
        if names:
            return f"names the task's answer does not use: {', '.join(sorted(names))}"
        if _TOWER.search(answer):
            return "an exponent with an exponent of its own"
        exponents = re.findall(r"(?:\*\*|\^)[\s(+-]*(\d+)", answer)
        if any(int(e) > _MAX_EXPONENT for e in exponents) or any(int(n) > _MAX_LITERAL * _MAX_LITERAL
                                                                 for n in re.findall(r"\d+", answer)):
            return "a number far beyond the task's"
    elif task in _LITERAL and answer.strip() != gold.strip():
        # the scorer `eval`s what is not its gold text, which pays (0.1-0.5) only for a Python
        # literal of the right value: anything else ("1<<99999999999", a format bomb) is refused
        try:
            ast.literal_eval(answer.strip())
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return "not the gold text, nor a Python literal"
    return None


_WORKER = r"""
import json, os, pickle, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a pathological answer fails here, not the machine
replies = os.fdopen(os.dup(1), "wb")  # the replies' own pipe: what a scorer prints goes to stderr
os.dup2(2, 1)
requests = sys.stdin.buffer
import reasoning_gym
scorers = {}
while True:
    head = requests.read(8)
    if len(head) < 8:
        break
    task, params, answer, entry = pickle.loads(requests.read(int.from_bytes(head, "big")))
    try:
        if (task, params) not in scorers:
            scorers[task, params] = reasoning_gym.create_dataset(task, **json.loads(params)).score_answer
        score = scorers[task, params]
    except Exception as err:
        score, reply = None, ["error", f"{type(err).__name__}: {err}"[:500]]
    replies.write(b"S")  # set up: the answer's own time starts now
    replies.flush()
    if score is not None:
        try:
            reply = ["score", float(score(answer, entry))]
        except Exception as err:
            reply = ["error", f"{type(err).__name__}: {err}"[:500]]
    data = json.dumps(reply).encode()
    replies.write(len(data).to_bytes(8, "big") + data)
    replies.flush()
"""
"""The scoring process's program: pickled requests from the trainer on stdin; on what was its
stdout, a byte "S" once it is ready to score the answer (imports and the task's scorer made),
then the JSON reply (never pickle: the trainer reads nothing from it that could run code)."""

SETUP_S = 120.0
"""How long the scoring process may take to start and make a task's scorer (~1 s when the
machine is idle) before that is an infrastructure failure: never the answer's time, which
`GymScorer.timeout_s` bounds from the moment the answer's own scoring starts (under a loaded
CI machine the start alone took over 1 s, and a right answer scored 0 against a 1 s limit)."""


class GymScorer:
    """reasoning-gym's ``score_answer`` in a process of its own (a fresh interpreter started on
    first use, ~1 s to import reasoning-gym), one answer at a time, each with a time limit;
    thread-safe."""

    def __init__(self, timeout_s: float = TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        # a fork while another thread held the lock would leave the child's copy locked for good
        os.register_at_fork(after_in_child=functools.partial(_after_fork, weakref.ref(self)))

    def _forked(self) -> None:
        """In a forked child: a lock of its own, and no process (its parent's pipes are the parent's)."""
        self._lock = threading.Lock()
        self._process = None

    def score(self, task: str, params: dict[str, Any] | None, answer: str, entry: dict[str, Any]) -> float:
        """The task's score for `answer`: 0.0 past the time limit; InfrastructureError when the
        scoring process could not be started or died; ValueError for the scorer's own error."""
        request = pickle.dumps((task, json.dumps(params or {}, sort_keys=True, default=repr), answer, entry))
        with self._lock:
            process = self._start()
            assert process.stdin is not None and process.stdout is not None
            try:
                process.stdin.write(len(request).to_bytes(8, "big") + request)
                process.stdin.flush()
                if self._read(process, 1, wait_s=SETUP_S) is None:
                    self._stop()
                    raise InfrastructureError(f"reasoning_gym: the scoring process was not ready to score within "
                                              f"{SETUP_S:.0f} s (starting, or making the {task} scorer)")
                head = self._read(process, 8, wait_s=self.timeout_s)
                if head is None:
                    self._stop()
                    log.warning("reasoning_gym %s: scoring an answer took over %.0f s; it scores 0 (%r)",
                                task, self.timeout_s, answer[:80])
                    return 0.0
                kind, value = json.loads(self._read(process, int.from_bytes(head, "big")) or b"")
            except (OSError, ValueError, TypeError) as err:
                self._stop()
                raise InfrastructureError(f"reasoning_gym: the scoring process died or broke off ({err!r})") from None
        if kind == "error":
            raise ValueError(f"reasoning_gym {task}: the task's scorer failed: {value}")
        if kind != "score" or type(value) is not float:
            raise InfrastructureError("reasoning_gym: the scoring process broke the protocol")
        return value

    def _read(self, process: subprocess.Popen[bytes], n: int, wait_s: float | None = None) -> bytes | None:
        """`n` bytes from the process; None when the first byte took longer than ``wait_s``."""
        assert process.stdout is not None
        fd, data = process.stdout.fileno(), b""
        while len(data) < n:
            if wait_s is not None and not data and not select.select([fd], [], [], wait_s)[0]:
                return None
            chunk = os.read(fd, n - len(data))
            if not chunk:
                raise OSError("the scoring process ended")
            data += chunk
        return data

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is not None and self._process.poll() is None:
            return self._process
        try:
            self._process = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as err:
            raise InfrastructureError(f"reasoning_gym: could not start the scoring process ({err})") from None
        return self._process

    def _stop(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            for pipe in (self._process.stdin, self._process.stdout):
                if pipe is not None:
                    pipe.close()
        self._process = None

    def close(self) -> None:
        with self._lock:
            self._stop()


def _after_fork(scorer: weakref.ref[GymScorer]) -> None:
    alive = scorer()
    if alive is not None:
        alive._forked()


_SCORER = GymScorer()


def score(task: str, params: dict[str, Any] | None, answer: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's score for `answer`, guarded (see the module docstring): 0.0 for an answer
    `refused`, one past the time limit, or a score that is not a finite number (clipped to [0, 1]);
    the answer `tidied` first."""
    answer = tidied(answer, str(entry.get("answer", "")))
    why = refused(task, answer, entry)
    if why is not None:
        log.debug("reasoning_gym %s: refused %r (%s)", task, answer[:80], why)
        return 0.0
    value = _SCORER.score(task, params, answer, entry)
    return min(max(value, 0.0), 1.0) if math.isfinite(value) else 0.0
