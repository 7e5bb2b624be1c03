"""Reward and zero-spread curves of several runs against wall-clock time, in one PNG, for the
comparisons in docs/LOG.md. Time is each run's summed step_seconds (evaluations excluded), so runs
that do more per step are compared at equal time, not at equal steps.

    python bench/plot_runs.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from itertools import accumulate
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(out: str, specs: list[str]) -> None:
    fig, (ax_reward, ax_spread) = plt.subplots(1, 2, figsize=(10, 3.6))
    for spec in specs:
        label, _, run = spec.partition("=")
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
        minutes = [s / 60 for s in accumulate(r["step_seconds"] for r in rows)]
        summary = json.loads((Path(run) / "summary.json").read_text())
        after = summary.get("eval_after", {}).get("eval/accuracy")
        name = f"{label} (held-out {after:.0%})" if after is not None else label
        ax_reward.plot(minutes, [r["reward"] for r in rows], marker=".", label=name)
        ax_spread.plot(minutes, [r["zero_std_fraction"] for r in rows], marker=".", label=label)
    ax_reward.set(title="reward of the step's rollouts", xlabel="minutes of training")
    ax_spread.set(title="groups with all rewards equal", xlabel="minutes of training")
    for ax in (ax_reward, ax_spread):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
