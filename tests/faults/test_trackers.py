"""Faults of the experiment trackers (W&B, MLflow, TensorBoard): one that cannot start stops the
run at once, naming it; one that fails mid-run is switched off (tests/test_tracking.py); the
status a tracker keeps says how the run ended; a torn trackers.json does not stop a resume."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from rlvr.cli import main
from rlvr.config import load_config
from rlvr.log import tracking
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

pytestmark = pytest.mark.dtype_independent  # what these faults end in does not depend on "auto" precision


class Recording:
    """A tracker that keeps what it was told, in `log`."""

    log_: list[Any] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log(self, step: int, metrics: Any) -> None:
        Recording.log_.append(step)

    def close(self, outcome: str = "finished") -> None:
        Recording.log_.append(f"closed {outcome}")


class NeverStarts:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ConnectionError("the tracking server refused the connection")


def test_a_tracker_that_cannot_start_stops_the_run_naming_it(tiny_dir: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    """A tracker whose start fails: a bare traceback before, with the trackers opened before it
    left open. Now `rlvr train` exits 2 naming it, after closing those as failed."""
    Recording.log_ = []
    monkeypatch.setitem(tracking.TRACKERS, "tensorboard", Recording)
    monkeypatch.setitem(tracking.TRACKERS, "mlflow", NeverStarts)
    code = main(["train", *overrides(tiny_dir, tmp_path, "t"), 'log.sinks=["tensorboard", "mlflow"]'])
    err = capsys.readouterr().err
    assert code == 2 and "error: log sink mlflow could not start (ConnectionError: the tracking server refused" in err
    assert "leave 'mlflow' out of log.sinks" in err and f"rlvr train --resume {tmp_path / 't'}" in err
    assert Recording.log_ == ["closed failed"]


def test_an_unreachable_mlflow_server_fails_the_start_within_a_minute(tiny_dir: Path, tmp_path: Path) -> None:
    """MLflow's own retries waited ~4 minutes for a server that is not there."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once the socket closes
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "m"), 'log.sinks=["mlflow"]',
                             f'log.sink_kwargs.mlflow.uri="http://127.0.0.1:{port}"'])
    start = time.monotonic()
    with pytest.raises(tracking.TrackerError, match="log sink mlflow could not start"):
        train(cfg, quiet=True)
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("how", ["failed", "interrupted"])
def test_the_tracker_status_says_how_the_run_ended(how: str, tiny_dir: Path, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that crashed was recorded FINISHED by MLflow (and exit code 0 by W&B)."""
    from mlflow import MlflowClient

    import rlvr.train.update as update

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the learner failed") if how == "failed" else KeyboardInterrupt()

    monkeypatch.setattr(update, "_accumulate", broken)
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "s"), 'log.sinks=["mlflow"]'])
    with pytest.raises(RuntimeError if how == "failed" else KeyboardInterrupt):
        train(cfg, quiet=True)
    run = tmp_path / "s"
    state = json.loads((run / tracking.STATE_FILE).read_text())
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    assert client.get_run(state["mlflow_run_id"]).info.status == {"failed": "FAILED", "interrupted": "KILLED"}[how]
    monkeypatch.undo()
    train(resume=run, quiet=True)  # the same MLflow run goes on, and finishes
    assert client.get_run(state["mlflow_run_id"]).info.status == "FINISHED"


def test_a_torn_trackers_file_does_not_stop_the_resume(tiny_dir: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """trackers.json cut off by a kill stopped every resume with "Invalid control character"."""
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "torn"), 'log.sinks=["mlflow"]', "checkpoint_every=1"])
    train(cfg, quiet=True)
    run = tmp_path / "torn"
    (run / tracking.STATE_FILE).write_text('{"mlflow_run_id": "ab')
    warned: list[str] = []
    monkeypatch.setattr("rlvr.train.loop.ConsoleProgress.print", lambda self, text: warned.append(text))
    train(resume=run, overrides=("train.steps=3",), quiet=True)
    assert any("trackers.json is not readable JSON" in w for w in warned)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert json.loads((run / tracking.STATE_FILE).read_text())["mlflow_run_id"]  # whole again
