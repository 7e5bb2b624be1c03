"""Checkpoints that resume exactly: the model in Hugging Face format plus everything that moves.

`checkpoints/step_000010/` holds the model (loadable by plain `from_pretrained`), its tokenizer,
and `trainer_state.pt`: optimizer (with the fp32 master weights), scheduler, sampler position,
the engine's and the update's random generators, the global RNG states, and the step. It is
written to a temporary folder and renamed, so a crash never leaves a half-written checkpoint; an
old one is pruned by renaming it out of the listing before deleting it, so a crash never leaves a
half-deleted one either (the next save removes such leftovers). A write that fails (a full disk,
whichever writer meets it: an OSError, safetensors' SafetensorError, torch.save's RuntimeError)
removes its temporary folder, keeps the checkpoints before it, and raises CheckpointError saying
what to free and how to resume; a save that leaves less free space than one more checkpoint
takes logs a warning, before the next save fails.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.lora import save_merged

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"

logger = logging.getLogger("rlvr.train")


class CheckpointError(RuntimeError):
    """A checkpoint could not be written (most often: the disk is full). The run stops here; the
    checkpoints before it are intact."""


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any], keep: int,
                    resume_command: str = "", beside: Callable[[Path], dict[str, Any]] | None = None) -> Path:
    """The checkpoint of ``step`` (see the module docstring). ``beside(folder)`` writes what is
    kept elsewhere than this process into the checkpoint being written (sharded learners'
    shares) and returns entries for its training state."""
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    remove_leftovers(run_dir)
    try:
        tmp.mkdir(parents=True)
        save_merged(model, tmp)  # a LoRA policy as its merged model, with the adapter in adapter/
        tokenizer.save_pretrained(tmp)
        if beside is not None:
            state = {**state, **beside(tmp)}
        torch.save({**state, "step": step, "rng": capture_rng()}, tmp / STATE_FILE)
        (tmp / "step.json").write_text(json.dumps({"step": step}) + "\n")
    except Exception as err:  # noqa: BLE001 - a full disk is an OSError in some writers, not all:
        # safetensors raises SafetensorError, torch.save's zip writer RuntimeError("[enforce fail ...")
        shutil.rmtree(tmp, ignore_errors=True)  # give back what the partial write took
        raise CheckpointError(_write_failed(run_dir, step, err, resume_command)) from err
    if final.exists():
        _discard(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        _discard(old)
    _warn_if_the_next_will_not_fit(final)
    return final


def _discard(checkpoint: Path) -> None:
    """Remove a checkpoint folder: renamed out of the listing first (one step), then deleted, so
    that a kill while deleting leaves a hidden leftover (`remove_leftovers`), never a `step_N`
    folder holding part of a checkpoint."""
    trash = checkpoint.with_name(f".trash_{checkpoint.name}")
    shutil.rmtree(trash, ignore_errors=True)
    checkpoint.rename(trash)
    shutil.rmtree(trash, ignore_errors=True)


def remove_leftovers(run_dir: Path) -> list[Path]:
    """Delete what a killed save or prune left in the checkpoints folder: a temporary folder, a
    checkpoint renamed for deletion, and a `step_N` folder older than the newest complete
    checkpoint that lacks its training state (a prune killed mid-delete before `_discard`
    renamed first). Returns what it removed."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    done = list_checkpoints(run_dir)
    newest = done[-1].name if done else None
    gone = [p for p in root.iterdir() if p.is_dir() and (
        p.name.startswith(".trash_") or (p.name.startswith(".step_") and p.name.endswith(".tmp"))
        or (p.name.startswith("step_") and not (p / STATE_FILE).is_file() and newest is not None and p.name < newest))]
    for path in gone:
        shutil.rmtree(path, ignore_errors=True)
    return gone


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _gb(n: float) -> str:
    """A size in GB, or in MB or kB below a tenth of one (a small model's checkpoint)."""
    for unit, size in (("GB", 1e9), ("MB", 1e6)):
        if n >= size / 10:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def _write_failed(run_dir: Path, step: int, err: Exception, resume_command: str) -> str:
    done = list_checkpoints(run_dir)
    free = shutil.disk_usage(run_dir).free
    cause = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
    what = f"could not write the step-{step} checkpoint in {Path(run_dir) / CHECKPOINTS}: {cause}"
    if not done:
        return f"{what} ({_gb(free)} free). No checkpoint was completed; free space and start the run again."
    last = done[-1]
    resume = f" and resume with `{resume_command}`" if resume_command else " and resume the run with --resume"
    return (f"{what}. {_gb(free)} free; a checkpoint takes {_gb(folder_bytes(last))}. The last complete one, "
            f"{last.name}, is intact: free space (or lower keep_checkpoints){resume}.")


def _warn_if_the_next_will_not_fit(checkpoint: Path) -> None:
    """A save writes the new checkpoint before it prunes old ones, so it needs one checkpoint's
    size free; say so a save ahead, while the run can still be stopped cleanly."""
    size, free = folder_bytes(checkpoint), shutil.disk_usage(checkpoint).free
    if free < size:
        logger.warning("only %s free beside %s, and a checkpoint takes %s: the next save will fail. Free disk "
                       "space or lower keep_checkpoints.", _gb(free), checkpoint.parent, _gb(size))


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary folders of an interrupted save are ignored)."""
    root = Path(run_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step_*") if (p / STATE_FILE).is_file())


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def load_state(checkpoint: Path) -> dict[str, Any]:
    # weights_only=False: the state holds RNG tuples and numpy arrays, written by rlvr itself.
    # map_location: a GPU run's checkpoint loads on a CPU-only machine (the learner's
    # load_state_dict takes each tensor to its parameter's device).
    return torch.load(Path(checkpoint) / STATE_FILE, weights_only=False, map_location="cpu")


def check_files(checkpoint: Path) -> None:
    """Raise if a file of `checkpoint` cannot be read: every safetensors file's header (where a
    file cut off shows; reading the header does not load the weights), and every JSON file (the
    model's config, the tokenizer's files), naming the file."""
    from safetensors import safe_open

    for path in sorted(Path(checkpoint).rglob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    for path in sorted(Path(checkpoint).rglob("*.json")):
        try:
            json.loads(path.read_text())
        except (UnicodeDecodeError, ValueError) as err:
            raise ValueError(f"{path.name} is not readable JSON ({err})") from None


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop rows logged after `last_step`, so that a resumed run appends where the checkpoint was.
    A last line cut off mid-write (a kill, a full disk) is dropped with them; a broken line
    elsewhere is an error that names the file and line."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if number == len(lines):  # the row being written when the run stopped
                break
            raise ValueError(f"{path}:{number}: not a JSON row, so the run cannot be resumed past it "
                             f"(remove or mend the line): {line[:80]!r}") from None
        if not isinstance(row, dict) or row.get("step", 0) <= last_step:
            kept.append(line)
    write_atomic(path, "".join(line + "\n" for line in kept))


def write_atomic(path: Path, text: str) -> None:
    """`text` at `path`, written whole or not at all: a temporary file renamed over it, so a run
    killed meanwhile leaves the old file or the new one (summary.json cut off in place stopped a
    resume)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
