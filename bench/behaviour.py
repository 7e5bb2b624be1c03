"""Does a change keep training behaviour? Runs a set of configs on two checkouts, compares metrics.

    python bench/behaviour.py --base 4303cac                  # base commit vs the working tree
    python bench/behaviour.py --base HEAD~3 --cases gae chord
    python bench/behaviour.py --compare runs-a runs-b         # two recordings made earlier

Each case is a short run on the bundled model (`rlvr train`, through the CLI, so any checkout
can run it): the demo for 5 steps as the README runs it, and small runs that switch on one
method each (a critic, the expert hybrids, ReMax, KL in the reward, the rehearsal divergence,
RLP, a multi-turn environment, rollout replay). Both checkouts run on this machine, one after the
other, so the comparison holds on any CPU: training is deterministic for a seed on one machine,
not across machines. Every metrics.jsonl row must be equal apart from timing fields. The base
checkout is a `git worktree` in a temporary folder, run with PYTHONPATH pointing at it and this
environment's packages.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = {"generate_seconds", "train_seconds", "step_seconds", "tokens_per_second", "elapsed_seconds",
          "dist/rollout_seconds"}
SMALL = ["train.steps=3", "train.prompts_per_step=4", "algo.group_size=4", "sampling.max_new_tokens=24",
         "task.eval_size=8", "train.micro_batch_size=8"]
DEMO = ["--config", "configs/demo.toml"]
CASES: dict[str, list[str]] = {
    "demo": [*DEMO, "train.steps=5"],
    "gae": [*DEMO, *SMALL, 'algo.advantage="gae"'],
    "chord": [*DEMO, *SMALL, 'expert.mode="chord"', "expert.kwargs.mu_peak=0.3"],
    "luffy": [*DEMO, *SMALL, 'expert.mode="luffy"', 'algo.loss="luffy"'],
    "relift": [*DEMO, *SMALL, 'expert.mode="relift"', "expert.kwargs.batch=2", "expert.kwargs.max_accuracy=0.5"],
    "remax": [*DEMO, *SMALL, 'algo.advantage="remax"'],
    "kl_reward": [*DEMO, *SMALL, "algo.kl_coef=0.05", 'algo.kl_placement="reward"', "algo.kl_adaptive.target=0.01"],
    "divergence": [*DEMO, *SMALL, 'algo.divergence="forward_kl"', "algo.divergence_kwargs.prompts=8",
                   "algo.divergence_kwargs.min_correct=1", "algo.divergence_kwargs.batch=4"],
    "rlp": ["--config", "configs/rlp.toml", *SMALL],
    "env": ["--config", "configs/guess_number.toml", *SMALL, "train.eval_every=0"],
    "replay": [*DEMO, *SMALL, "sampler.replay.fraction=0.5"],
    # the cases issue 52 adds: the per-token estimators, the losses with a row statistic, and a VLM
    "opd": [*DEMO, *SMALL, 'algo.advantage="opd"', 'algo.advantage_kwargs={teacher = "builtin:smollm2-135m-instruct", '
            "outcome_weight = 1.0}"],
    "process": [*DEMO, *SMALL, 'algo.advantage="process"',
                'algo.advantage_kwargs={prm = "rlvr.rewards.process:arithmetic_steps", outcome_weight = 1.0}'],
    "sapo": [*DEMO, *SMALL, 'algo.loss="sapo"'],
    "gmpo": [*DEMO, *SMALL, 'algo.loss="gmpo"'],
    "clip_cov": [*DEMO, *SMALL, 'algo.loss="clip_cov"'],
    "vlm": ["model={vlm}", 'task.source="visual"', 'task.name="count"', "task.params={max_shapes = 4}",
            'task.instruction="Answer with the number."', *SMALL],
}
VLM_SEED = 1
"""The "vlm" case's model: tests.tiny's random Llava (seed 1), saved once into the recording folder
and read by both checkouts."""


def tiny_vlm(folder: Path) -> Path:
    if not (folder / "config.json").is_file():
        sys.path.insert(0, str(ROOT))
        from tests.tiny import make_tiny_vlm

        model, processor = make_tiny_vlm(seed=VLM_SEED)
        model.save_pretrained(folder)
        processor.save_pretrained(folder)
    return folder


def record(checkout: Path, out: Path, cases: list[str]) -> None:
    """Run each case with `checkout`'s rlvr; metrics land in out/<case>/metrics.jsonl."""
    # the fixed forms of the fp32 decode products, not the plan probed on this CPU: the same forms on
    # both checkouts (one before session 15 knows no other), so only the change compared can differ
    env = {**os.environ, "PYTHONPATH": str(checkout), "RLVR_PRODUCTS": "fixed"}
    for case in cases:
        args = [a.replace("{vlm}", json.dumps(str(tiny_vlm(out.parent / "tiny_vlm")))) for a in CASES[case]]
        cmd = [sys.executable, "-m", "rlvr.cli", "train", *args, f"name={case}", f"output_dir={json.dumps(str(out))}",
               "log.report=false"]
        print(f"{checkout.name}: {case}", flush=True)
        done = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{case} failed in {checkout}:\n{done.stderr[-3000:]}")
        shutil.rmtree(out / case / "checkpoints", ignore_errors=True)  # ~1.5 GB a case; only metrics are compared


def differences(a: Path, b: Path) -> list[str]:
    """Where two recordings' metrics differ (timing fields aside)."""
    out = []
    for case in sorted(p.name for p in a.iterdir() if (p / "metrics.jsonl").is_file()):
        rows_a = [json.loads(line) for line in (a / case / "metrics.jsonl").read_text().splitlines()]
        path_b = b / case / "metrics.jsonl"
        if not path_b.is_file():
            out.append(f"{case}: missing in {b}")
            continue
        rows_b = [json.loads(line) for line in path_b.read_text().splitlines()]
        if len(rows_a) != len(rows_b):
            out.append(f"{case}: {len(rows_a)} rows vs {len(rows_b)}")
        for ra, rb in zip(rows_a, rows_b):
            keys = (ra.keys() | rb.keys()) - TIMING
            for key in sorted(keys):
                va, vb = ra.get(key), rb.get(key)
                same = va == vb or (isinstance(va, float) and isinstance(vb, float) and math.isnan(va) and math.isnan(vb))
                if not same:
                    out.append(f"{case} step {ra.get('step')}: {key} {va!r} vs {vb!r}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", help="git revision to compare the working tree with")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two recordings")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--keep", type=Path, help="record into this folder (base/ and tree/) instead of a temporary one")
    args = parser.parse_args()
    if args.compare:
        diffs = differences(Path(args.compare[0]), Path(args.compare[1]))
    else:
        if not args.base:
            parser.error("give --base REV or --compare A B")
        work = args.keep or Path(tempfile.mkdtemp(prefix="rlvr-behaviour-"))
        base = work / "checkout"
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(base), args.base], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            record(base, work / "base", args.cases)
            record(ROOT, work / "tree", args.cases)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base)], cwd=ROOT, capture_output=True)
        diffs = differences(work / "base", work / "tree")
        print(f"recordings: {work}/base, {work}/tree")
    for line in diffs[:50]:
        print(line)
    print(f"{len(diffs)} differences" if diffs else "identical metrics (timing aside)")
    sys.exit(1 if diffs else 0)


if __name__ == "__main__":
    main()
