"""Faults of the Ray scale-out (docs/distributed.md): a learner rank that hangs or dies in the
update, a rollout worker that dies in a collection and one that never answers a weight broadcast.
Each ends in recovery that is logged (a restarted worker, counted in dist/worker_restarts) or an
error within dist.ray.timeout_s that names the rank or worker and says where the run resumes
from. (verl #6583 and TRL #6797 report runs that hung instead.)"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

import rlvr.scaleout.rollout as scaleout_rollout
from rlvr.cli import main
from rlvr.config import load_config
from rlvr.scaleout.rollout import RolloutWorker
from rlvr.train.loop import train
from tests.test_train import FP32, TIMING, overrides, read_metrics

pytestmark = pytest.mark.dtype_independent  # what these faults end in does not depend on "auto" precision


@pytest.fixture(scope="module", autouse=True)
def local_ray() -> Iterator[None]:
    """One local Ray for the module, shut down after it (tests/test_scaleout.py starts its own)."""
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


TIMEOUT = 30
"""dist.ray.timeout_s in these tests: the actors' start must fit in it too, on a loaded machine."""
WITHIN = 2 * TIMEOUT + 30
"""The longest a test may take to fail: the start (Ray, the actors loading the model), the wait
for the fault, and closing (which no longer waits for a hung rank a second time)."""


def hangs_on_a_learner_actor(prompt: str, steps: list[str], answer: object = None, **example: object) -> list[float]:
    """A function PRM that never returns on rank 1, leaving rank 0 waiting in a collective."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        time.sleep(10**6)
    return [0.5 for _ in steps]


def dies_on_a_learner_actor(prompt: str, steps: list[str], answer: object = None, **example: object) -> list[float]:
    """A function PRM whose process dies on rank 1 (SIGKILL: the OOM killer, a lost node)."""
    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        os.kill(os.getpid(), signal.SIGKILL)
    return [0.5 for _ in steps]


@pytest.mark.parametrize(("prm", "said"), [
    ("dies_on_a_learner_actor", "learner rank 1 failed during the update"),
    ("hangs_on_a_learner_actor", f"learner rank 1 did not answer during the update within dist.ray.timeout_s = {TIMEOUT} s"),
], ids=["killed", "hangs"])
def test_a_learner_rank_that_dies_or_hangs_in_the_update_is_named(prm: str, said: str, tiny_dir: Path,
                                                                  tmp_path: Path) -> None:
    """A hung rank: gloo's own timeout named no rank and no setting, and closing waited as long
    again for it to leave (50 s at a 20 s timeout; ~10 minutes at the default)."""
    settings = ['algo.advantage="process"', "train.micro_batch_size=4",
                f'algo.advantage_kwargs={{prm = "tests.faults.test_ray:{prm}", delimiter = " "}}']
    start = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        main(["train", *overrides(tiny_dir, tmp_path, "rank"), *settings, "dist.learners=2",
              f"dist.ray.timeout_s={TIMEOUT}"])
    assert time.monotonic() - start < WITHIN
    assert said in str(caught.value)
    assert any(f"rlvr train --resume {tmp_path / 'rank'}" in note for note in caught.value.__notes__)


DIED = Path(tempfile.gettempdir()) / "rlvr-test-rollout-worker-died"


class DiesInItsFirstCollection(RolloutWorker):
    """A rollout worker that kills its own process in the middle of its first collection (the
    flag file says a worker did so already: the restarted one lives)."""

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        flag = DIED  # (a path both processes know: the actor's environment is Ray's, not the test's)
        if not flag.exists():
            flag.write_text("died")
            os.kill(os.getpid(), signal.SIGKILL)
        return super().generate(*args, **kwargs)


class AlwaysDies(RolloutWorker):
    def generate(self, *args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGKILL)


class NeverLoadsVersion2(RolloutWorker):
    """A worker whose weight load hangs at the second broadcast (a stalled sync)."""

    def update_weights(self, state: Any, version: int) -> int:
        if version == 2:
            time.sleep(10**6)
        return super().update_weights(state, version)


RAY = ["dist.rollout_workers=1", f"dist.ray.timeout_s={TIMEOUT}", *FP32]


def test_a_rollout_worker_killed_mid_collection_is_restarted_and_the_run_is_the_same(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """The restarted worker samples its shard again from the same seeds: every row is the run a
    worker that never died makes, and the restart is logged and counted."""
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "calm"), *RAY]), quiet=True)
    monkeypatch.setattr(scaleout_rollout, "RolloutWorker", DiesInItsFirstCollection)
    DIED.unlink(missing_ok=True)
    with caplog.at_level("WARNING", logger="rlvr.scaleout"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "died"), *RAY]), quiet=True)
    assert DIED.exists() and any("rollout worker 0 died" in r.getMessage() for r in caplog.records)
    calm, died = read_metrics(tmp_path / "calm"), read_metrics(tmp_path / "died")
    assert died[-1]["dist/worker_restarts"] == 1.0
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("dist/")}  # noqa: E731
                          for r in rows]
    assert strip(died) == strip(calm)


@pytest.mark.parametrize("fault", ["always dies", "stalls"])
def test_a_rollout_worker_that_cannot_go_on_stops_the_run_naming_it(
        fault: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A worker that dies at every restart, or never answers a weight broadcast (a stalled sync):
    the run stops within dist.ray.timeout_s naming the worker and saying where it resumes from."""
    monkeypatch.setattr(scaleout_rollout, "RolloutWorker", AlwaysDies if fault == "always dies" else NeverLoadsVersion2)
    start = time.monotonic()
    run = tmp_path / "broken"
    if fault == "always dies":  # an unforeseen failure: its traceback, and the note where to resume
        with pytest.raises(RuntimeError) as caught:
            main(["train", *overrides(tiny_dir, tmp_path, "broken"), *RAY, "checkpoint_every=1"])
        assert "rollout worker 0 died three times in one call" in str(caught.value)
        assert any(f"rlvr train --resume {run}" in n for n in caught.value.__notes__)
    else:  # a timeout: rlvr's one-line error, and the note
        assert main(["train", *overrides(tiny_dir, tmp_path, "broken"), *RAY, "checkpoint_every=1"]) == 1
        err = capsys.readouterr().err
        assert f"waited {TIMEOUT} s for the weight broadcast (version 2) to the rollout workers" in err
        assert f"its newest complete checkpoint is step_000001: resume with `rlvr train --resume {run}`" in err
    assert time.monotonic() - start < WITHIN
