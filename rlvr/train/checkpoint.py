"""Checkpoints that resume exactly: the model in Hugging Face format plus everything that moves.

`checkpoints/step_000010/` holds the model (loadable by plain `from_pretrained`), its tokenizer,
and `trainer_state.pt`: optimizer (with the fp32 master weights), scheduler, sampler position,
the engine's and the update's random generators, the global RNG states, and the step. It is
written to a temporary folder and renamed, so a crash never leaves a half-written checkpoint.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr.lora import save_merged

CHECKPOINTS = "checkpoints"
STATE_FILE = "trainer_state.pt"


def capture_rng() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def restore_rng(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def save_checkpoint(run_dir: Path, step: int, model: Any, tokenizer: Any, state: dict[str, Any], keep: int) -> Path:
    root = Path(run_dir) / CHECKPOINTS
    final = root / f"step_{step:06d}"
    tmp = root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_merged(model, tmp)  # a LoRA policy as its merged model, with the adapter in adapter/
    tokenizer.save_pretrained(tmp)
    torch.save({**state, "step": step, "rng": capture_rng()}, tmp / STATE_FILE)
    (tmp / "step.json").write_text(json.dumps({"step": step}) + "\n")
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old)
    return final


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
    return torch.load(Path(checkpoint) / STATE_FILE, weights_only=False)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop rows logged after `last_step`, so that a resumed run appends where the checkpoint was."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines() if line and json.loads(line).get("step", 0) <= last_step]
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(path)
