"""Multi-turn rollout speed with and without reusing keys and values across turns.

    python bench/multiturn.py configs/guess_number.toml [--steps 2] [overrides...]

Runs `--steps` training steps of the config twice in fresh processes: "whole", every turn's
contexts prefilled whole (the engine before shared prefixes), and "reused", the engine as it is
(each group's prompt encoded once, and a turn's context encoding only what the last turn added).
Prints generation seconds per step and the ratio, with the CPU. Same seed, so both sample the
same episodes up to float rounding."""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import tempfile


def one(config: str, steps: int, mode: str, overrides: list[str]) -> list[dict]:
    from rlvr.config import load_config
    from rlvr.rollout import engine as engine_module
    from rlvr.train.loop import train

    if mode == "whole":
        engine_module.plan_prefixes = lambda prompts, *a, **k: None  # type: ignore[assignment]
        engine_module.EmbeddedEngine.reusing_prefixes = lambda self: contextlib.nullcontext()  # type: ignore[method-assign, assignment, return-value]
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(config, (f"train.steps={steps}", "train.eval_every=0", f"output_dir={out}", f"name={mode}",
                                   *overrides))
        train(cfg, quiet=True)
        with open(f"{out}/{mode}/metrics.jsonl") as f:
            return [json.loads(line) for line in f if "generate_seconds" in line]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mode", choices=["whole", "reused"], help=argparse.SUPPRESS)
    args, overrides = ap.parse_known_args()
    if args.mode:
        print(json.dumps(one(args.config, args.steps, args.mode, overrides)))
        return
    from rlvr.models import cpu_description, cpu_line

    print(cpu_line(cpu_description()))
    rows = {}
    for mode in ("whole", "reused"):
        done = subprocess.run([sys.executable, __file__, args.config, "--steps", str(args.steps), "--mode", mode,
                               *overrides], capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the {mode} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
        rows[mode] = json.loads(done.stdout.strip().splitlines()[-1])
    for k in range(args.steps):
        w, r = rows["whole"][k], rows["reused"][k]
        print(f"step {k + 1}: generation {w['generate_seconds']:.1f} s whole, {r['generate_seconds']:.1f} s reused "
              f"({w['generate_seconds'] / r['generate_seconds']:.2f}x); step {w['step_seconds']:.1f} s against "
              f"{r['step_seconds']:.1f} s; reward {w['reward']:.3f} / {r['reward']:.3f}")


if __name__ == "__main__":
    main()
