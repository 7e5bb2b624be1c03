"""reasoning-gym's scorers behind rlvr's guard: each answer a red-team review found scoring without
solving (or running as code, or never finishing) against reasoning-gym 0.1.25 scores 0 here, and
every task's own gold answers still score 1 (see rlvr.rewards.gym_scoring)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym

from rlvr.data import reasoning_gym_examples
from rlvr.errors import InfrastructureError
from rlvr.rewards import gym_scoring
from rlvr.rewards.builtin import reasoning_gym_reward

pytestmark = pytest.mark.dtype_independent


def entries(task: str, size: int = 3) -> list[dict[str, Any]]:
    return [e.fields["entry"] for e in reasoning_gym_examples(task, size=size, seed=0, params={})]


def ours(task: str, answer: str, entry: dict[str, Any]) -> float:
    return reasoning_gym_reward("", f"<answer>{answer}</answer>", task=task, entry=entry, params={})


def upstream(task: str, answer: str, entry: dict[str, Any]) -> float:
    return float(reasoning_gym.create_dataset(task).score_answer(answer, entry))


def integrand(entry: dict[str, Any]) -> str:
    return str(entry["metadata"]["integrand"])


# (task, the hack for an entry): each scores 1.0 against reasoning-gym's own scorer
HACKS = [
    ("puzzle24", lambda e: "1*2*3*4"),  # never checked against the puzzle's numbers
    ("complex_arithmetic", lambda e: "nan"),  # min(1.0, exp(-nan)) is 1.0
    ("simple_integration", lambda e: f"integrate({integrand(e)}, {e['metadata']['variable']})"),
    ("intermediate_integration", lambda e: f"integrate({integrand(e)}, {e['metadata']['variable']})"),
    ("polynomial_multiplication", lambda e: f"expand({e['metadata']['polynomial_expr']})"),
]


@pytest.mark.parametrize("task,hack", HACKS, ids=[h[0] for h in HACKS])
def test_a_hack_that_fools_reasoning_gyms_own_scorer_scores_zero(task: str, hack: Any) -> None:
    for entry in entries(task):
        answer = hack(entry)
        assert upstream(task, answer, entry) == 1.0, f"the hack should work upstream: {answer!r}"
        assert ours(task, answer, entry) == 0.0, answer


def test_countdown_reached_without_the_targets_digits_scores_zero() -> None:
    entry = entries("countdown", 1)[0]
    numbers = entry["metadata"]["numbers"]
    target = entry["metadata"]["target"]
    hack = f"ord({chr(target)!r}) + len('')*({'+'.join(map(str, numbers))})"
    assert upstream("countdown", hack, entry) == 1.0
    assert ours("countdown", hack, entry) == 0.0


@pytest.mark.parametrize("task", ["puzzle24", "countdown", "simple_integration", "spiral_matrix",
                                  "binary_matrix", "string_insertion", "n_queens", "polynomial_multiplication"])
def test_an_answer_that_is_python_code_never_runs(task: str, tmp_path: Path) -> None:
    """reasoning-gym evaluates these tasks' answers (`eval`, or sympy's `parse_expr`, which calls it)."""
    mark = tmp_path / "ran"
    code = f"__import__('pathlib').Path({str(mark)!r}).touch()"
    for answer in (code, f"1*2*3*4 + len(str({code}))*0", f"[{code}]"):
        assert ours(task, answer, entries(task, 1)[0]) == 0.0
    assert not mark.exists()


def test_an_answer_that_would_compute_for_ever_is_refused_or_cut_off() -> None:
    entry = entries("puzzle24", 1)[0]
    start = time.perf_counter()
    assert ours("puzzle24", "9**9**9", entry) == 0.0  # refused: not + - * / on the puzzle's numbers
    assert ours("simple_integration", "X**(9**9**9)", entries("simple_integration", 1)[0]) == 0.0
    assert time.perf_counter() - start < 5
    scorer = gym_scoring.GymScorer(timeout_s=1.0)  # the process's time limit, without the refusals
    try:
        start = time.perf_counter()
        assert scorer.score("puzzle24", {}, "9**9**9", entry) == 0.0
        assert time.perf_counter() - start < 10
        assert scorer.score("puzzle24", {}, entry["answer"], entry) == 1.0  # a fresh process goes on
    finally:
        scorer.close()


def test_the_time_limit_is_the_answers_not_the_process_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """Starting the scoring process and making a task's scorer take ~1 s (more on a loaded
    machine): under a limit shorter than that a right answer still scores 1, where it scored 0
    in CI; a process that cannot get ready at all is an infrastructure failure, not a 0."""
    entry = entries("puzzle24", 1)[0]
    scorer = gym_scoring.GymScorer(timeout_s=0.3)  # the start alone takes ~1 s here
    try:
        assert scorer.score("puzzle24", {}, entry["answer"], entry) == 1.0
    finally:
        scorer.close()
    monkeypatch.setattr(gym_scoring, "SETUP_S", 0.01)
    scorer = gym_scoring.GymScorer()
    try:
        with pytest.raises(InfrastructureError, match="not ready to score within"):
            scorer.score("puzzle24", {}, entry["answer"], entry)
    finally:
        scorer.close()


@pytest.mark.parametrize("task", ["puzzle24", "countdown", "simple_integration", "intermediate_integration",
                                  "polynomial_multiplication", "spiral_matrix", "binary_matrix", "n_queens",
                                  "string_insertion", "complex_arithmetic", "chain_sum", "letter_counting"])
def test_every_gold_answer_still_scores_one(task: str) -> None:
    for entry in entries(task, 5):
        assert ours(task, str(entry["answer"]), entry) == 1.0, entry["answer"]


def test_a_python_literal_still_reaches_a_scorer_that_evaluates_one() -> None:
    """spiral_matrix pays 0.1 for its answer written as a Python list."""
    entry = entries("spiral_matrix", 1)[0]
    literal = "[" + ", ".join(entry["answer"].split()) + "]"
    assert ours("spiral_matrix", literal, entry) == upstream("spiral_matrix", literal, entry) == 0.1


def test_a_scorer_that_fails_is_an_error_and_a_dead_process_is_infrastructure(monkeypatch: pytest.MonkeyPatch) -> None:
    scorer = gym_scoring.GymScorer()
    try:
        with pytest.raises(ValueError, match="no_such_task"):
            scorer.score("no_such_task", {}, "1", {})
    finally:
        scorer.close()
    monkeypatch.setattr(gym_scoring, "_WORKER", "import sys; sys.stdin.buffer.read(8); sys.exit(0)")
    dying = gym_scoring.GymScorer()
    try:
        with pytest.raises(InfrastructureError, match="scoring process"):
            dying.score("chain_sum", {}, "1", {})
    finally:
        dying.close()


def test_a_unicode_minus_or_a_full_stop_after_a_number_is_read_as_meant() -> None:
    """reasoning-gym's chain_sum scores `−14282` (U+2212) 0 against `-14282`, decimal_arithmetic
    `-12.5825.` against `-12.5825`."""
    entry = next(e for e in entries("chain_sum", 40) if str(e["answer"]).startswith("-"))
    gold = str(entry["answer"])
    for answer in (gold.replace("-", "\u2212"), gold.replace("-", "\u2212 ")):
        assert upstream("chain_sum", answer, entry) < 1.0
        assert ours("chain_sum", answer, entry) == 1.0, answer
    assert ours("chain_sum", gold + " .", entry) == 1.0
    decimal = entries("decimal_arithmetic", 1)[0]  # compares strings: a full stop after the number fails there
    assert upstream("decimal_arithmetic", f"{decimal['answer']}.", decimal) < 1.0
    assert ours("decimal_arithmetic", f"{decimal['answer']}.", decimal) == 1.0
    assert ours("chain_sum", gold.lstrip("-") + ".", entry) == 0.0  # still the number it is
    assert gym_scoring.tidied("1.", "1.") == "1." and gym_scoring.tidied("\u22121", "\u22121") == "\u22121"


def test_what_a_second_review_slipped_past_the_screen_is_refused() -> None:
    """`nani` (nan followed by a letter), `Integral(...)` where a degenerate gold holds one, and
    an expression where a scorer `eval`s a literal (a memory bomb) (session 19's diff review)."""
    complex_entry = entries("complex_arithmetic", 1)[0]
    for answer in ("nani", "1+nanj", "NaN+1j"):
        assert ours("complex_arithmetic", answer, complex_entry) == 0.0, answer
    assert upstream("complex_arithmetic", "1+nanj", complex_entry) == 1.0
    entry = {"answer": "x**2/2 + Integral(x*sin(x), x) + C", "metadata": {"variable": "x"}}
    assert gym_scoring.refused("intermediate_integration", "Integral(x*sin(x)) + x**2/2 + C", entry)
    assert gym_scoring.refused("intermediate_integration", "x**2/2 + C", entry) is None
    spiral = entries("spiral_matrix", 1)[0]
    for answer in ("1<<99999999999", "'%9999999999s' % ''", "1 2 3 x"):
        assert gym_scoring.refused("spiral_matrix", answer, spiral), answer
    assert gym_scoring.refused("spiral_matrix", "[1, 2]", spiral) is None
