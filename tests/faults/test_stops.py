"""Faults that stop a run: each ends in an error that names what failed and says where the run
resumes from (rlvr.train.stop.resumable), with the checkpoints before it intact, and the resumed
run is the one that would have run."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

import rlvr.rollout.static_decode as static_decode
import rlvr.train.update as update
from bench.kill_resume import TIMING
from rlvr.cli import main
from rlvr.config import load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics


def _fail_on_call(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, call: int, error: BaseException) -> None:
    """``owner.name`` raises ``error`` on its ``call``-th call (and runs as itself otherwise)."""
    real = getattr(owner, name)
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)


def _calls(owner: Any, name: str, tiny_dir: Path, tmp_path: Path, steps: int) -> int:
    """How many times a run calls ``owner.name`` up to the end of its step `steps` (its first
    evaluation included, none held out here): a fault on the next call falls in the next step."""
    calls = {"n": 0}
    real = getattr(owner, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(owner, name, counting)
        train(load_config(None, [*overrides(tiny_dir, tmp_path, f"count{name}"), f"train.steps={steps}",
                                 "task.eval_size=0"]), quiet=True)
    return calls["n"]


def test_the_engine_running_out_of_memory_stops_with_what_to_lower_and_how_to_resume(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The CPU allocator fails inside step 2's generation: `rlvr train` exits 2 with the engine's
    error (what it was asked to sample, which settings shrink it) and the resume command, step 1's
    checkpoint intact; the resume trains step 2 as the uninterrupted run did."""
    args = [*overrides(tiny_dir, tmp_path, "oom"), "checkpoint_every=1", "task.eval_size=0"]
    first = _calls(static_decode.StaticDecoder, "step", tiny_dir, tmp_path, 1)
    _fail_on_call(monkeypatch, static_decode.StaticDecoder, "step", first + 2,
                  RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 68719476736 bytes. Error code 12 (Cannot allocate memory)"))
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "error: the rollout engine ran out of memory on cpu sampling 4 prompts × 4 samples" in err
    assert "engine.max_batch_size" in err and "Traceback" not in err
    run = tmp_path / "oom"
    assert f"step 2 (generating); its newest complete checkpoint is step_000001: resume with `rlvr train --resume {run}`" in err
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight"), "checkpoint_every=1", "task.eval_size=0"]),
          quiet=True)
    strip = lambda rows: [{k: v for k, v in r.items() if not k.endswith(TIMING)} for r in rows]  # noqa: E731
    assert strip(read_metrics(run)) == strip(read_metrics(tmp_path / "straight"))


def test_a_second_ctrl_c_says_where_the_run_resumes_from(tiny_dir: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A second Ctrl-C aborts at once (a KeyboardInterrupt, here inside step 2's update): `rlvr`
    exited 130 and printed nothing, so the user never learnt that step 1's checkpoint stands."""
    first = _calls(update, "_accumulate", tiny_dir, tmp_path, 1)
    _fail_on_call(monkeypatch, update, "_accumulate", first + 1, KeyboardInterrupt())
    run = tmp_path / "abort"
    assert main(["train", *overrides(tiny_dir, tmp_path, "abort"), "checkpoint_every=1", "task.eval_size=0"]) == 130
    err = capsys.readouterr().err
    assert f"aborted: the run stopped in step 2 (training); its newest complete checkpoint is step_000001: resume " \
           f"with `rlvr train --resume {run}`" in err
    monkeypatch.undo()
    assert main(["train", "--resume", str(run)]) == 0
    assert [r["step"] for r in read_metrics(run)] == [1, 2]


def test_an_unexpected_error_keeps_its_traceback_and_says_where_to_resume(tiny_dir: Path, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug or a failure nobody foresaw propagates as it is (its traceback is what finds it), with
    the resume note beneath: before its first checkpoint, a resume starts it again."""
    _fail_on_call(monkeypatch, update, "_accumulate", 1, RuntimeError("a bug in the loss"))
    with pytest.raises(RuntimeError, match="a bug in the loss") as caught:
        main(["train", *overrides(tiny_dir, tmp_path, "bug"), "checkpoint_every=1"])
    notes = caught.value.__notes__
    assert notes == [f"the run stopped in step 1 (training); its newest complete checkpoint is step_000000: resume "
                     f"with `rlvr train --resume {tmp_path / 'bug'}`"]


_interrupts = {"calls": 0, "at": (), "n": 0}


def interrupting(prompt: str, completion: str, **_: Any) -> float:
    """distinct_chars, and a SIGINT to this process at the chosen calls (a user's Ctrl-C)."""
    import os
    import signal

    _interrupts["calls"] += 1
    if _interrupts["calls"] in _interrupts["at"]:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # the handler runs on the main thread, while this one waits
    return len(set(completion)) / 8.0


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_the_final_evaluation(presses: int, tiny_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The final evaluation runs after the last checkpoint: one Ctrl-C there said "stopping after
    this step and saving a checkpoint" and then finished as if nothing had happened; two exited
    130 saying nothing. One now says the evaluation is being finished; two stop at once, saying
    where a resume finishes the run."""
    calls_before_final = 4 + 2 * 16  # the evaluation before (4 held-out prompts), 2 steps of 4 × 4
    _interrupts.update(calls=0, at=tuple(calls_before_final + 1 + i for i in range(presses)))
    args = [*overrides(tiny_dir, tmp_path, "fin", reward="distinct_chars"),
            'rewards=[{fn = "tests.faults.test_stops:interrupting", name = "chars"}]']
    code = main(["train", *args])
    err = capsys.readouterr().err
    run = tmp_path / "fin"
    summary = json.loads((run / "summary.json").read_text())
    if presses == 1:
        assert code == 0 and "eval_after" in summary
        assert "training is done and its last checkpoint saved; finishing the final evaluation" in err
    else:
        assert code == 130 and "eval_after" not in summary
        assert f"aborted: the run stopped in its final evaluation, after step 2; its newest complete checkpoint is " \
               f"step_000002: resume with `rlvr train --resume {run}`" in err
        _interrupts["at"] = ()
        assert main(["train", "--resume", str(run)]) == 0
        assert "eval_after" in json.loads((run / "summary.json").read_text())
