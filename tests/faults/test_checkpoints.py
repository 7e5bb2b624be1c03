"""Faults around checkpoints: a disk that fills while one is written, a kill while old ones are
pruned. Each ends in a loud error that names the checkpoint and the command to resume, with the
earlier checkpoints intact, or in a run that resumes as if nothing happened (issue 50, bug 7: a
full disk during `torch.save` was a bare RuntimeError traceback, and a kill during the prune left
a `step_000000/` folder holding three of its files)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from rlvr.config import load_config
from rlvr.train import checkpoint
from rlvr.train.checkpoint import CheckpointError
from rlvr.train.loop import train
from tests.faults.conftest import fill
from tests.test_train import overrides, read_metrics


def _stops_with_resume_command(run: Path, error: CheckpointError, *causes: str) -> None:
    message = str(error)
    assert "step-2 checkpoint" in message and any(cause in message for cause in causes), message
    assert "step_000001, is intact" in message and f"rlvr train --resume {run}" in message
    # nothing half-written is left beside the intact checkpoints
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000", "step_000001"]


@pytest.mark.parametrize("fails_in", ["weights", "trainer state"])
def test_a_disk_that_fills_during_a_checkpoint_stops_the_run_and_it_resumes(
        fails_in: str, tiny_dir: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real ENOSPC from the kernel, in safetensors' writer (a SafetensorError, not an OSError) or
    in torch.save's zip writer (RuntimeError "[enforce fail at inline_container.cc:672] ...
    unexpected pos"): the disk fills just before the step-2 save, leaving no room for the weights,
    or room for the weights and not the trainer state."""
    real = checkpoint.save_merged
    filler: list[Path] = []

    def fill_the_disk_first(model: object, folder: Path) -> None:
        if folder.name == ".step_000002.tmp":
            weights = (folder.parent / "step_000001" / "model.safetensors").stat().st_size
            filler.append(fill(small_disk, 0 if fails_in == "weights" else weights + 256 * 1024))
        real(model, folder)

    monkeypatch.setattr(checkpoint, "save_merged", fill_the_disk_first)
    cfg = load_config(None, [*overrides(tiny_dir, small_disk, "full"), "train.steps=3", "checkpoint_every=1"])
    with pytest.raises(CheckpointError) as caught:
        train(cfg, quiet=True)
    run = small_disk / "full"
    # a full disk: the folder's small files (OSError), the weights (SafetensorError), or the state
    causes = ("No space left on device", "SafetensorError") if fails_in == "weights" else ("RuntimeError: [enforce fail",)
    _stops_with_resume_command(run, caught.value, *causes)
    filler[0].unlink()  # the user frees space
    monkeypatch.setattr(checkpoint, "save_merged", real)
    train(resume=run, quiet=True)
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "step_000003" / checkpoint.STATE_FILE).is_file()


def _torch_save_fails_in(monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    """torch.save raises, into `folder`, what its zip writer raised on a full disk."""
    real = torch.save

    def full(obj: object, path: object, *args: object, **kwargs: object) -> None:
        if folder in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 8640 vs 8534")
        real(obj, path, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch, "save", full)


def test_torch_saves_full_disk_error_is_a_checkpoint_error_everywhere(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same failure without a small disk (it runs on any machine): torch.save raising what its
    zip writer raised on the full disk."""
    _torch_save_fails_in(monkeypatch, ".step_000002.tmp")
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "full"), "train.steps=3", "checkpoint_every=1"])
    with pytest.raises(CheckpointError) as caught:
        train(cfg, quiet=True)
    _stops_with_resume_command(tmp_path / "full", caught.value, "unexpected pos")


def test_the_cli_says_how_to_resume_after_a_failed_save(tiny_dir: Path, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    from rlvr.cli import main

    _torch_save_fails_in(monkeypatch, ".step_000001.tmp")
    code = main(["train", *overrides(tiny_dir, tmp_path, "cli"), "checkpoint_every=1"])
    err = capsys.readouterr().err
    assert code == 2 and "error: could not write the step-1 checkpoint" in err and "Traceback" not in err
    assert f"rlvr train --resume {tmp_path / 'cli'}" in err


def test_a_kill_while_old_checkpoints_are_pruned_leaves_no_partial_checkpoint(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A prune renames the old checkpoint out of the listing before deleting it: a kill inside the
    delete (here: the delete stops after one file) leaves a hidden leftover, which the next save
    removes, and never a `step_N` folder that holds part of a checkpoint. A partial `step_N`
    folder that an older rlvr left behind is removed too."""
    real = shutil.rmtree
    killed: list[Path] = []

    def killed_mid_delete(path: object, *args: object, **kwargs: object) -> None:
        path = Path(str(path))
        if path.name.startswith(".trash_step") and path.is_dir() and not killed:
            killed.append(path)
            next(p for p in path.iterdir() if p.is_file()).unlink()
            raise KeyboardInterrupt  # stands for SIGKILL: nothing after this line runs
        real(path, *args, **kwargs)  # type: ignore[arg-type]

    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "prune"), "train.steps=3", "checkpoint_every=1",
                             "keep_checkpoints=2"])
    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_mid_delete)
    with pytest.raises(KeyboardInterrupt):
        train(cfg, quiet=True)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real)
    run = tmp_path / "prune"
    left = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert left == [".trash_step_000000", "step_000001", "step_000002"], left
    # what an older rlvr's killed prune left: a step folder without its training state
    partial = run / "checkpoints" / "step_000000"
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    train(resume=run, quiet=True)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000002", "step_000003"]
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]


@pytest.mark.parametrize("broken", ["config.json", "tokenizer.json", "trainer_state.pt", "model.safetensors"])
def test_a_corrupt_file_in_the_latest_checkpoint_is_named_and_the_one_before_resumes(
        broken: str, tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Garbage in a JSON file of the newest checkpoint (the model's config, the tokenizer) stopped
    the resume with "cannot load model ...: not available from the Hugging Face Hub" or a bare
    "Expecting value", naming no file and passing over the intact checkpoint before it; a cut-off
    state or weight file was already moved aside. Each is now named, moved aside, and the run
    resumes from the one before it."""
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "bad"), "checkpoint_every=1", "keep_checkpoints=3"]),
          quiet=True)
    run = tmp_path / "bad"
    target = run / "checkpoints" / "step_000002" / broken
    data = target.read_bytes()
    target.write_bytes(b"garbage{{{" if broken.endswith(".json") else data[: len(data) // 2])
    train(resume=run, overrides=("train.steps=3",), quiet=True)
    err = capsys.readouterr().err
    assert "step_000002 cannot be read" in err and (broken in err or not broken.endswith(".json"))
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3]
    assert (run / "checkpoints" / "unreadable_step_000002").is_dir()
