"""Why a run learns nothing: the step's share of groups with no sample right (too hard) or every
sample right (too easy), and the one-time note that says so (issue 53: on 3-term chain_sum 76-88%
of GRPO's groups were all wrong and nothing was learned, and the run did not say why)."""

from __future__ import annotations

from rlvr.train.records import SignalWatch
from rlvr.train.rollouts import group_metrics
from rlvr.types import Completion, Group, Sample


def _sample(correct: float | None) -> Sample:
    parts = {"r": 0.0, "r/error": 1.0, "r/excluded": 1.0} if correct is None else {"r": correct}
    return Sample((1,), Completion((2,), (0.0,), "stop", "x"), parts["r"], parts, 0)


def test_groups_without_signal_are_told_apart_by_cause() -> None:
    wrong = Group("a", (_sample(0.0), _sample(0.0), _sample(None)))  # the failed verdict is neither
    right = Group("b", (_sample(1.0), _sample(1.0)))
    mixed = Group("c", (_sample(1.0), _sample(0.0)))
    partial = Group("d", (_sample(0.5), _sample(0.5)))  # no full marks: unsolved, and no signal either
    unjudged = Group("e", (_sample(None),) * 2)  # no verdict at all: counted in neither share
    m = group_metrics([wrong, right, mixed, partial, unjudged], "r")
    assert m["unsolved_fraction"] == 2 / 4 and m["solved_fraction"] == 1 / 4
    assert "unsolved_fraction" not in group_metrics([unjudged], "r")


def _row(flat: float, unsolved: float, solved: float) -> dict[str, float]:
    return {"zero_std_fraction": flat, "unsolved_fraction": unsolved, "solved_fraction": solved}


def test_the_note_comes_once_per_cause_after_a_full_window_above_the_threshold() -> None:
    watch = SignalWatch(window=3, threshold=0.75)
    assert watch.observe(_row(0.9, 0.9, 0.0)) is None and watch.observe(_row(0.9, 0.9, 0.0)) is None  # window not full
    assert watch.observe({"step": 3}) is None  # a skipped step's row neither counts nor breaks the window
    note = watch.observe(_row(0.6, 0.6, 0.0))  # mean 0.8 ≥ 0.75
    assert note is not None and "too hard" in note and "80%" in note and "When nothing learns" in note
    assert watch.observe(_row(0.9, 0.9, 0.0)) is None  # said once
    notes = [watch.observe(_row(1.0, 0.0, 1.0)) for _ in range(5)]
    # the window turns to solved groups at the second row; the other cause is said once too
    assert notes[0] is None and notes[1] is not None and "too easy" in notes[1] and notes[2:] == [None] * 3


def test_the_hard_note_names_the_demonstrations_and_knows_when_a_run_already_uses_them() -> None:
    plain, relift = SignalWatch(window=1), SignalWatch(window=1, expert_mode="relift")
    note = plain.observe(_row(1.0, 1.0, 0.0))
    assert note is not None and "sft.task_examples" in note and 'expert.mode = "warm_start"' in note
    note = relift.observe(_row(1.0, 1.0, 0.0))
    assert note is not None and 'learns from demonstrations (expert.mode = "relift")' in note
    assert "or expert.mode" not in note  # it does not suggest another mode to a run that has one


def test_no_note_below_the_threshold() -> None:
    watch = SignalWatch(window=2, threshold=0.75)
    assert [watch.observe(_row(0.7, 0.7, 0.0)) for _ in range(10)] == [None] * 10
