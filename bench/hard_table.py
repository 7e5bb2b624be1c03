"""Issue 22's chain_sum comparison from bench/hard_task.sh's runs, read from each run's own files
(summary.json, metrics.jsonl; `rlvr eval`'s pass@k where it was run): per run, the steps its 15
minutes bought, the greedy held-out accuracy before, every 5 steps and after, the training
reward of the first and last third of its steps, and the fraction of groups with no reward
variance (no learning signal for group-relative methods). Usage:
python bench/hard_table.py /tmp/hard [label ...]"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}"  # None: no prompt got a verdict


def main() -> None:
    root = Path(sys.argv[1])
    runs = sorted(p.parent for p in root.glob("*-seed*/summary.json"))
    labels = sys.argv[2:] or sorted({r.name.split("-seed")[0] for r in runs}, key=lambda x: (x != "grpo", x))
    print("| run | steps | held-out before → every 5 steps → after | reward, first → last third | zero-variance groups "
          "| pass@1 / pass@8 |")
    print("|---|---|---|---|---|---|")
    for label in labels:
        for run in (r for r in runs if r.name.split("-seed")[0] == label):
            summary = json.loads((run / "summary.json").read_text())
            if "eval_after" not in summary:  # still running
                continue
            rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
            curve = [pct(r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
            third = max(1, len(rows) // 3)
            first, last = (statistics.fmean(r["reward"] for r in part if "reward" in r) if any("reward" in r for r in part)
                           else float("nan") for part in (rows[:third], rows[-third:]))
            zero = statistics.fmean(r["zero_std_fraction"] for r in rows)
            evaluated = root / f"{run.name}.eval.json"
            passes = "–"
            if evaluated.exists():
                e = json.loads(evaluated.read_text())[0]
                passes = f"{pct(e.get('pass@1'))} / {pct(e.get('pass@8'))}"
            print(f"| {run.name} | {len(rows)} | {pct(summary['eval_before'].get('eval/accuracy'))} → {', '.join(curve)} → "
                  f"{pct(summary['eval_after'].get('eval/accuracy'))} | {first:.3f} → {last:.3f} | {zero:.2f} | {passes} |")


if __name__ == "__main__":
    main()
