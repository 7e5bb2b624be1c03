"""The issue-22 comparison table from bench/method_seeds.sh's output: per method, over its seeds,
the final model's pass@1/4/8 (`rlvr eval`, 8 samples of each of the seed's 64 held-out prompts),
the greedy held-out accuracy before and after training (the run's own evaluation), the run's
wall-clock, and the paired difference from GRPO on the same seeds (the seeds draw held-out prompts
of different difficulty, so a method is compared with GRPO seed by seed: mean ± sd of the
per-seed differences in pass@1 and pass@8, points). A label ending in "_mb2" (two mini-batches a
step) is compared with "grpo_mb2", GRPO with the same setting; ``--against LABEL`` compares every
label with LABEL instead (e.g. float16 decoding with a sequence mask against float16 decoding
without one). Usage:
python bench/method_table.py /tmp/seeds [label ...] [--against LABEL]"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def mean_sd(values: list[float], scale: float = 100.0) -> str:
    if not values:
        return "–"
    m = statistics.fmean(values) * scale
    return f"{m:.1f}" if len(values) < 2 else f"{m:.1f} ± {statistics.stdev(values) * scale:.1f}"


def main() -> None:
    args = sys.argv[1:]
    against = None
    if "--against" in args:
        k = args.index("--against")
        against, args = args[k + 1], args[:k] + args[k + 2:]
    root = Path(args[0])
    labels = args[1:] or sorted({p.name.split("-seed")[0] for p in root.glob("*-seed*.eval.json")},
                                    key=lambda x: (x != "base", x != "grpo", x))
    print(f"(the baseline: {against}'s)\n" if against else "(GRPO's: grpo_mb2's for a *_mb2 label)\n")
    base = against or "GRPO"
    print("| method | seeds | pass@1 | pass@4 | pass@8 | greedy held-out after (before) | per seed pass@1 | run time "
          f"| pass@1 − {base}'s | pass@8 − {base}'s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label in labels:
        baseline = against or ("grpo_mb2" if label.endswith("_mb2") else "grpo")
        grpo = {_seed(p): json.loads(p.read_text())[0] for p in root.glob(f"{baseline}-seed*.eval.json")}
        evals = sorted(root.glob(f"{label}-seed*.eval.json"))
        rows = [json.loads(p.read_text())[0] for p in evals]
        after, before, seconds = [], [], []
        for p in evals:
            summary = root / p.name.removesuffix(".eval.json") / "summary.json"
            s = json.loads(summary.read_text()) if summary.exists() else {}
            if "eval/accuracy" in s.get("eval_after", {}) and "eval/accuracy" in s.get("eval_before", {}):
                after.append(s["eval_after"]["eval/accuracy"])
                before.append(s["eval_before"]["eval/accuracy"])
                metrics = (root / p.name.removesuffix(".eval.json") / "metrics.jsonl").read_text().splitlines()
                seconds.append(json.loads(metrics[-1])["elapsed_seconds"])
        greedy = f"{mean_sd(after)} ({mean_sd(before)})" if after else "–"
        seeds = ", ".join(f"{r['pass@1'] * 100:.1f}" if "pass@1" in r else "–" for r in rows)
        paired = {k: [r[k] - grpo[_seed(p)][k] for p, r in zip(evals, rows) if _seed(p) in grpo
                      and k in r and k in grpo[_seed(p)]] for k in ("pass@1", "pass@8")}
        diffs = " | ".join("–" if label in (baseline, "base") else mean_sd(v) for v in paired.values())
        rate = lambda k: mean_sd([r[k] for r in rows if k in r])  # noqa: E731  (absent: no judged samples)
        print(f"| {label} | {len(rows)} | {rate('pass@1')} | {rate('pass@4')} "
              f"| {rate('pass@8')} | {greedy} | {seeds} | "
              f"{mean_sd(seconds, 1.0) + ' s' if seconds else '–'} | {diffs} |")


def _seed(path: Path) -> int:
    return int(path.name.removesuffix(".eval.json").rsplit("-seed", 1)[1])


if __name__ == "__main__":
    main()
