"""The issue-22 comparison table from bench/method_seeds.sh's output: per method, over its seeds,
the final model's pass@1/4/8 (`rlvr eval`, 8 samples of each of the seed's 64 held-out prompts),
the greedy held-out accuracy before and after training (the run's own evaluation), and the run's
wall-clock. Usage: python bench/method_table.py /tmp/seeds [label ...]"""

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
    root = Path(sys.argv[1])
    labels = sys.argv[2:] or sorted({p.name.split("-seed")[0] for p in root.glob("*-seed*.eval.json")},
                                    key=lambda x: (x != "base", x != "grpo", x))
    print("| method | seeds | pass@1 | pass@4 | pass@8 | greedy held-out after (before) | per seed pass@1 | run time |")
    print("|---|---|---|---|---|---|---|---|")
    for label in labels:
        evals = sorted(root.glob(f"{label}-seed*.eval.json"))
        rows = [json.loads(p.read_text())[0] for p in evals]
        after, before, seconds = [], [], []
        for p in evals:
            summary = root / p.name.removesuffix(".eval.json") / "summary.json"
            if summary.exists():
                s = json.loads(summary.read_text())
                after.append(s["eval_after"]["eval/accuracy"])
                before.append(s["eval_before"]["eval/accuracy"])
                metrics = (root / p.name.removesuffix(".eval.json") / "metrics.jsonl").read_text().splitlines()
                seconds.append(json.loads(metrics[-1])["elapsed_seconds"])
        greedy = f"{mean_sd(after)} ({mean_sd(before)})" if after else "–"
        seeds = ", ".join(f"{r['pass@1'] * 100:.1f}" for r in rows)
        print(f"| {label} | {len(rows)} | {mean_sd([r['pass@1'] for r in rows])} | {mean_sd([r['pass@4'] for r in rows])} "
              f"| {mean_sd([r['pass@8'] for r in rows])} | {greedy} | {seeds} | "
              f"{mean_sd(seconds, 1.0) + ' s' if seconds else '–'} |")


if __name__ == "__main__":
    main()
