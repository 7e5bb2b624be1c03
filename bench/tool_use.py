"""How a tool_math run's tool use changed over training: per block of steps, tool calls per episode,
tool error rate, answer rate, accuracy, accuracy on two-digit problems, and accuracy among
answers given after a call that ran; plus the held-out evaluations. Writes a PNG beside the
table. Behind the tool-integrated arithmetic entry in docs/LOG.md.

    python bench/tool_use.py runs/tool-math-7 [docs/tool-math.png] [--block 5]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def two_digit(prompt: str) -> bool:
    numbers = re.findall(r"\d+", prompt.rsplit("problem:", 1)[-1])
    return any(len(n) >= 2 for n in numbers)


def main(run: Path, out: Path | None, block: int) -> None:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines() if line]
    last = max(r["step"] for r in rows)
    table = []
    for start in range(1, last + 1, block):
        block_steps = range(start, min(start + block, last + 1))
        ms = [r for r in rows if r["step"] in block_steps]
        ss = [s for s in samples if s["step"] in block_steps]
        hard = [s for s in ss if two_digit(s["prompt"])]
        ran = [s for s in ss if "Output:" in s["completion"] and "Error" not in s["completion"]]
        mean = lambda key: statistics.fmean(r.get(key, 0.0) for r in ms)  # noqa: E731
        table.append({
            "steps": f"{block_steps[0]}-{block_steps[-1]}", "calls": mean("env/tool_calls"),
            "error_rate": mean("env/tool_error_rate"), "answered": mean("env/answered"),
            # over the steps that have one (a step whose samples all lacked a verdict has none)
            "accuracy": statistics.fmean(r["accuracy"] for r in ms if "accuracy" in r) if any("accuracy" in r for r in ms)
            else float("nan"),
            "acc_2digit": statistics.fmean(s["reward"] >= 1 for s in hard) if hard else 0.0,
            "acc_after_call": statistics.fmean(s["reward"] >= 1 for s in ran) if ran else 0.0,
        })
    print("| steps | tool calls / episode | tool error rate | answered | accuracy | accuracy, two-digit | "
          "accuracy after a call that ran |")
    print("|---|---|---|---|---|---|---|")
    for t in table:
        print(f"| {t['steps']} | {t['calls']:.2f} | {t['error_rate']:.2f} | {t['answered']:.2f} | {t['accuracy']:.3f} | "
              f"{t['acc_2digit']:.3f} | {t['acc_after_call']:.3f} |")
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    evals = [(0, summary["eval_before"])] if "eval_before" in summary else []
    evals += [(r["step"], {k: v for k, v in r.items() if k.startswith("eval/")}) for r in rows if "eval/accuracy" in r]
    if "eval_after" in summary and (not evals or evals[-1][0] != last):
        evals.append((last, summary["eval_after"]))
    print("\n| held-out (greedy) at step | accuracy | answered | tool calls / episode | tool error rate |")
    print("|---|---|---|---|---|")
    for step, e in evals:
        print(f"| {step} | {e.get('eval/accuracy', float('nan')):.3f} | {e.get('eval/env/answered', 0):.2f} | "
              f"{e.get('eval/env/tool_calls', 0):.2f} | {e.get('eval/env/tool_error_rate', 0):.2f} |")
    if out is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    steps = [r["step"] for r in rows]
    axes[0].plot(steps, [r.get("env/tool_calls", 0) for r in rows], label="tool calls / episode")
    axes[0].plot(steps, [r.get("env/answered", 0) for r in rows], label="answered")
    axes[1].plot(steps, [r.get("env/tool_error_rate", 0) for r in rows], color="tab:red", label="tool error rate")
    # no accuracy where no sample got a verdict (rlvr.train.rollouts.judged_accuracy): a gap, not a 0
    axes[2].plot(steps, [r.get("accuracy", float("nan")) for r in rows], alpha=0.5, label="accuracy (training samples)")
    axes[2].plot([s for s, _ in evals], [e.get("eval/accuracy", float("nan")) for _, e in evals], marker="o",
                 label="held-out, greedy")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    fig.suptitle(f"{run.name}: tool use over training")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    block = int(sys.argv[sys.argv.index("--block") + 1]) if "--block" in sys.argv else 5
    if "--block" in sys.argv:
        args.remove(str(block))
    main(Path(args[0]), Path(args[1]) if len(args) > 1 else None, block)
