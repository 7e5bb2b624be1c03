"""SIGKILL at named points of `rlvr train`, then `rlvr train --resume`: every metrics and samples
row and the final weights equal an uninterrupted run's, bit for bit. These are a few of the points
of bench/kill_resume.py (its 100-point measurement on the demo config is in docs/LOG.md), on the
tiny model: inside generation, inside the update, in the middle of a checkpoint write, while an
old checkpoint is pruned, and inside a held-out evaluation. Each child kills itself the k-th time
it reaches its point, so nothing of rlvr's own gets to clean up."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from bench.kill_resume import _run, compare
from tests.test_train import overrides


def _args(tiny_dir: Path, out: Path, name: str) -> list[str]:
    return ["train", *overrides(tiny_dir, out, name, train__steps=4, checkpoint_every=1, keep_checkpoints=2,
                                train__eval_every=2)]


@pytest.fixture(scope="module")
def reference(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kill_reference")
    code, _ = _run(_args(tiny_dir, out, "reference"))
    assert code == 0
    return out / "reference"


@pytest.mark.parametrize(("point", "k"), [("generate", 20), ("update", 3), ("checkpoint_state", 3), ("prune", 1),
                                          ("evaluate", 2)])
def test_a_run_killed_at_a_point_resumes_to_the_same_run(point: str, k: int, reference: Path, tiny_dir: Path,
                                                          tmp_path: Path) -> None:
    code, _ = _run(_args(tiny_dir, tmp_path, "killed"), kill=f"{point}:{k}")
    assert code == -signal.SIGKILL, f"the run never reached {point} {k} times"
    code, _ = _run(["train", "--resume", str(tmp_path / "killed")])
    assert code == 0
    assert compare(reference, tmp_path / "killed") == []


def test_a_resume_where_the_machine_now_measures_otherwise_computes_the_same_numbers(
        reference: Path, tiny_dir: Path, tmp_path: Path) -> None:
    """The resume reads a cache in which every measurement changed ("auto" flipped between bf16
    and fp32, attention's limit, every product's form): it follows the choices its checkpoint
    recorded (rlvr.rollout.numerics) and computes the reference's numbers. Without them every
    resume diverged, and one resume of the demo in eleven did (issue 50, bug 8)."""
    from bench.kill_resume import measured_otherwise
    from rlvr.models import cache_dir

    code, _ = _run(_args(tiny_dir, tmp_path, "killed"), kill="update:3")
    assert code == -signal.SIGKILL
    other = measured_otherwise(cache_dir(), tmp_path / "other_cache")
    assert (other / "products.json").exists() and (other / "attention.json").exists() or \
        (other / "products.json").exists()  # fp32 runs widen no attention
    code, _ = _run(["train", "--resume", str(tmp_path / "killed")], env={"RLVR_CACHE": str(other)})
    assert code == 0
    assert compare(reference, tmp_path / "killed") == []


@pytest.mark.dtype_independent  # pinned to fp32
def test_an_asynchronous_run_killed_with_its_buffer_full_resumes_to_the_same_run(tiny_dir: Path,
                                                                                tmp_path: Path) -> None:
    """Killed in step 3's update, while step 4's collection is made ahead (or made already): the
    checkpoint of step 2 holds step 3's collection, and the resume trains it as it was sampled."""
    from tests.test_train import FP32

    def args(name: str) -> list[str]:
        return [*_args(tiny_dir, tmp_path, name), "dist.rollout_workers=1", "dist.async_rollouts={steps = 1}",
                "dist.ray.timeout_s=120", *FP32]

    assert _run(args("straight"))[0] == 0
    code, _ = _run(args("killed"), kill="optimizer:3")
    assert code == -signal.SIGKILL
    assert _run(["train", "--resume", str(tmp_path / "killed")])[0] == 0
    assert compare(tmp_path / "straight", tmp_path / "killed") == []
