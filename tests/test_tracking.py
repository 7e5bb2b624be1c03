"""Tracker sinks (TensorBoard, W&B offline, MLflow local store) fed by a real training run, with resume."""

from __future__ import annotations

import builtins
import json
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import ConfigError, load_config
from rlvr.log import tracking
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tensorboard"))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.one_precision
def test_all_three_sinks_receive_every_step_and_resume_continues_them(tiny_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    sinks = 'log.sinks=["tensorboard", "wandb", "mlflow"]'
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "tracked"), sinks, "log.sink_kwargs.wandb.mode=offline"]),
          quiet=True)
    run = tmp_path / "tracked"
    train(resume=run, overrides=("train.steps=3",), quiet=True)
    rewards = [r["reward"] for r in read_metrics(run)]

    # TensorBoard: one scalar per step, the same values as metrics.jsonl, eval at steps 0 and 3
    scalars = tensorboard_scalars(run, "reward")
    assert [s for s, _ in scalars] == [1, 2, 3]
    assert [v for _, v in scalars] == pytest.approx(rewards)
    assert [s for s, _ in tensorboard_scalars(run, "eval/accuracy")][0] == 0

    # MLflow: one run (resumed, not duplicated) in a local store under the run directory
    from mlflow import MlflowClient

    state = json.loads((run / tracking.STATE_FILE).read_text())
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    history = client.get_metric_history(state["mlflow_run_id"], "reward")
    assert [m.step for m in history] == [1, 2, 3]
    assert [m.value for m in history] == pytest.approx(rewards)
    experiment = client.get_experiment_by_name("rlvr")
    assert experiment is not None and len(client.search_runs([experiment.experiment_id])) == 1
    assert client.get_run(state["mlflow_run_id"]).data.params["algo.group_size"] == "4"

    # W&B offline: both sessions wrote to the same run id; its history records hold our keys
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2 and all(state["wandb_id"] in f.name for f in files)
    assert b"clip_fraction" in files[0].read_bytes() and b"grad_norm" in files[-1].read_bytes()


def test_metric_names_are_made_valid_for_mlflow() -> None:
    assert tracking.mlflow_key("pass@4") == "pass_at_4"
    assert tracking.mlflow_key("rewards/format (x)") == "rewards/format _x_"


def test_only_finite_numbers_reach_the_trackers() -> None:
    row = {"step": 3, "reward": 0.5, "flag": True, "name": "x", "nan": float("nan"), "inf": float("inf")}
    assert tracking.numeric(row) == {"step": 3.0, "reward": 0.5}


def test_a_failing_tracker_is_switched_off_and_the_others_go_on() -> None:
    seen: list[Any] = []
    warnings: list[str] = []

    class Broken:
        def log(self, step: int, metrics: Any) -> None:
            raise OSError("disk full")

        def close(self, outcome: str = "finished") -> None:
            pass

    class Good:
        def log(self, step: int, metrics: Any) -> None:
            seen.append((step, dict(metrics)))

        def close(self, outcome: str = "finished") -> None:
            seen.append("closed")

    trackers = tracking.Trackers({"broken": Broken(), "good": Good()}, warnings.append)
    trackers.log(1, {"reward": 1.0})
    trackers.log(2, {"reward": 2.0})
    trackers.close()
    assert seen == [(1, {"reward": 1.0}), (2, {"reward": 2.0}), "closed"]
    assert len(warnings) == 1 and "broken failed" in warnings[0] and "disk full" in warnings[0]


def test_a_missing_package_names_the_extra_before_any_work(tiny_dir: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    monkeypatch.setattr(tracking, "import_module", lambda name: no_wandb(name))
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "nowandb"), 'log.sinks=["wandb"]'])
    with pytest.raises(tracking.MissingExtra, match=r"pip install 'rlvr\[wandb\]'"):
        train(cfg, quiet=True)
    assert not (tmp_path / "nowandb").exists()


def test_an_unknown_sink_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="log.sinks"):
        load_config(None, ['log.sinks=["neptune"]'])


def test_sink_settings_are_checked_against_their_tracker() -> None:
    cfg = load_config(None, ['log.sinks=["wandb"]', 'log.sink_kwargs.wandb={project = "p", mode = "offline"}'])
    assert cfg.log.sink_kwargs == {"wandb": {"project": "p", "mode": "offline"}}
    with pytest.raises(ConfigError, match="did you mean 'project'"):
        load_config(None, ['log.sinks=["wandb"]', 'log.sink_kwargs.wandb.projetc="p"'])
    with pytest.raises(ConfigError, match="mode must be"):
        load_config(None, ['log.sinks=["wandb"]', 'log.sink_kwargs.wandb.mode="later"'])
    with pytest.raises(ConfigError, match="log.sinks does not name"):
        load_config(None, ['log.sink_kwargs.mlflow.uri="http://x"'])
    with pytest.raises(ConfigError, match="'log.wandb_project' is now log.sink_kwargs.wandb.project"):
        load_config(None, ['log.wandb_project="p"'])
