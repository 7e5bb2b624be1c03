"""Per budget, how long a run's sampled answers were and how often right, early against late
(docs/LOG.md, issue 56's length control): reads a run's samples.jsonl, whose prompts carry the
budget ("Answer in about N tokens.").

    python bench/budget_lengths.py runs/budget [--steps 3]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

BUDGET = re.compile(r"about (\d+) tokens")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("--steps", type=int, default=3, help="how many first and last steps to compare")
    args = parser.parse_args()
    rows = [json.loads(line) for line in (args.run / "samples.jsonl").read_text().splitlines()]
    last = max(r["step"] for r in rows)
    for name, keep in (("first", lambda s: s <= args.steps), ("last", lambda s: s > last - args.steps)):
        by: dict[int, list[dict]] = {}
        for r in rows:
            m = BUDGET.search(r["prompt"])
            if m and keep(r["step"]):
                by.setdefault(int(m.group(1)), []).append(r)
        for budget, rs in sorted(by.items()):
            n = [r["completion_tokens"] for r in rs]
            right = [r["rewards"].get("reasoning_gym", 0.0) >= 1.0 for r in rs]
            print(f"{name} {args.steps} steps  budget {budget:4d}: {len(rs):4d} samples, length mean "
                  f"{statistics.fmean(n):6.1f} median {statistics.median(n):5.1f}, mean |n - b| / b "
                  f"{statistics.fmean(abs(x - budget) / budget for x in n):.2f}, accuracy {statistics.fmean(right):.2f}")


if __name__ == "__main__":
    main()
