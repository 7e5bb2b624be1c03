"""A self-correction run's attempts, early against late (docs/LOG.md, issue 56): first- and
last-attempt accuracy, fixes and breaks at the training temperature (metrics.jsonl, means over
the first, middle and last three steps), and the held-out greedy evaluation (summary.json).

    python bench/self_correct_attempts.py runs/self_correct [more runs ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

KEYS = ("env/first_correct", "accuracy", "env/fixed", "env/broken", "env/changed")


def main() -> None:
    for run in map(Path, sys.argv[1:]):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        middle = len(rows) // 2
        for name, part in (("first 3", rows[:3]), ("middle 3", rows[middle - 1 : middle + 2]), ("last 3", rows[-3:])):
            values = "  ".join(f"{k.removeprefix('env/')} {statistics.fmean(r[k] for r in part):.3f}" for k in KEYS)
            print(f"{run.name} steps {name}: {values}")
        summary = json.loads((run / "summary.json").read_text())
        for when in ("eval_before", "eval_after"):
            e = summary[when]
            print(f"{run.name} {when}: first {e['eval/env/first_correct']:.3f}  last {e['eval/accuracy']:.3f}  "
                  f"fixed {e['eval/env/fixed']:.3f}  broken {e['eval/env/broken']:.3f}")


if __name__ == "__main__":
    main()
