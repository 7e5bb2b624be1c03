"""Shared prompts in the learner against whole rows, on the demo's own updates.

    python bench/shared_prompts.py [updates] [repeats] [config overrides ...]

Runs the demo (configs/demo.toml, with any overrides given, e.g. `sampling.max_new_tokens=128
train.prompts_per_step=1` for `rlvr bench`'s 1 × 8 GRPO shape) for `updates` steps (default
3), keeping the groups and settings each update received; then times those updates again in one
process under five variants, interleaved, `repeats` times (default 3, the first not counted):
whole rows (share_prompts=False), prompts shared with a group's rows kept together, by
completion length, the default (the cheaper of the two cuts, rlvr.train.batches.micro_batches),
and the default with each completion in a pass row of its own ("default, unpacked": no
`completion_lanes`, as before session 17). The learning rate is tiny so that the policy barely
moves between repeats.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rlvr.runtime import keep_freed_memory


def captured_updates(steps: int, overrides: list[str]) -> list[tuple[Any, Any]]:
    import rlvr.train.updater as updater
    from rlvr.config import load_config
    from rlvr.train.loop import setup, train_step

    out = tempfile.mkdtemp()
    cfg = load_config("configs/demo.toml", [f"output_dir={out}", "task.eval_size=0", "log.report=false", *overrides])
    run = setup(cfg, Path(out))
    caught = []
    original = updater.update_policy

    def spy(learner: Any, groups: Any, settings: Any, **kw: Any) -> Any:
        caught.append((groups, settings))
        return original(learner, groups, settings, **kw)

    updater.update_policy = spy  # type: ignore[assignment]
    for step in range(1, steps + 1):
        train_step(run, step)
    updater.update_policy = original  # type: ignore[assignment]
    return caught


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    keep_freed_memory()
    import rlvr.train.batches as batches
    import rlvr.train.logprobs as logprobs
    import rlvr.train.update as update
    from rlvr.bench import MODEL
    from rlvr.models import load_model
    from rlvr.train.learner import Learner

    caught = captured_updates(steps, sys.argv[3:])
    lengths = [sorted(len(x.completion.token_ids) for g in groups for x in g.samples) for groups, _ in caught]
    print("completion lengths per update:", lengths)
    learner = Learner(load_model(MODEL, "auto"), lr=1e-9)
    default = batches.micro_batches

    def ordered(key: Any) -> Any:
        def cut(indices: list[int], samples: list[Any], size: int, max_tokens: int | None = None,
                by_prompt: bool = False, lanes: bool = True) -> list[list[int]]:
            order = sorted(indices, key=lambda i: key(samples[i]))
            cuts = batches.token_budget_batches([samples[i].num_tokens for i in order], max_tokens, size)
            return [[order[j] for j in c] for c in cuts]
        return cut

    variants = {
        "whole rows": (False, default),
        "together": (True, ordered(lambda x: (len(x.prompt_ids), x.prompt_ids, len(x.completion.token_ids)))),
        "by length": (True, ordered(lambda x: (len(x.completion.token_ids), x.prompt_ids))),
        "default": (True, default),
        "default, unpacked": (True, default),
    }
    lanes = logprobs.completion_lanes

    def unpacked(fed: list[int], row_prompt: list[int], width: int) -> list[list[int]]:
        return [[b] for b in range(len(fed))]  # a pass row per sample: the padded pass

    seconds = {name: 0.0 for name in variants}
    for repeat in range(repeats):
        for name, (share, cut) in variants.items():
            update.micro_batches = cut  # type: ignore[assignment]
            logprobs.completion_lanes = unpacked if "unpacked" in name else lanes
            for groups, settings in caught:
                start = time.perf_counter()
                update.update_policy(learner, groups, dataclasses.replace(settings, share_prompts=share), pad_token_id=0)
                if repeat:
                    seconds[name] += time.perf_counter() - start
    update.micro_batches = default  # type: ignore[assignment]
    logprobs.completion_lanes = lanes
    base = seconds["whole rows"]
    for name, s in seconds.items():
        print(f"{name:>10}: {s:6.2f} s over {len(caught)} updates × {repeats - 1}, {base / s:.2f}× whole rows")


if __name__ == "__main__":
    main()
