"""Resident memory after each of several learner updates (16 × 256 tokens, micro-batch 4,
activation checkpointing): does it grow, and what does the malloc tuning cost?

    python bench/learner_memory.py 1     # with rlvr.runtime.keep_freed_memory()
    python bench/learner_memory.py 0     # without
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

from rlvr.bench import fake_groups
from rlvr.models import load_model
from rlvr.runtime import keep_freed_memory
from rlvr.train.learner import Learner
from rlvr.train.settings import LossSettings, Passes
from rlvr.train.update import UpdateSettings, update_policy


def main() -> None:
    if sys.argv[1:] == ["1"]:
        keep_freed_memory()
    model = load_model("builtin:smollm2-135m-instruct", "auto")
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    learner = Learner(model, lr=1e-6)
    groups = fake_groups(16, 8, 64, 192, model.config.vocab_size)
    settings = UpdateSettings(loss=LossSettings(max_tokens=192), passes=Passes(micro_batch_size=4))
    for step in range(1, 5):
        update_policy(learner, groups, settings, pad_token_id=0)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        print(f"after update {step}: RSS {rss_gb():.2f} GB, peak {peak:.2f} GB", flush=True)


def rss_gb() -> float:
    """Current resident set size (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 2**20
    return float("nan")


if __name__ == "__main__":
    main()
