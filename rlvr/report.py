"""`rlvr report`: a run directory as one self-contained HTML page (curves over steps and a rollout
browser; no network, the data is inside the file) and a PNG of the main curves.

Inputs are the run's own files: metrics.jsonl, samples.jsonl, summary.json, config.toml. The
report can be made at any time, also while the run is still writing them (a half-written last
line is ignored). The page's script and style live in rlvr/assets/report.html.
"""

from __future__ import annotations

import base64
import json
import re
from collections import OrderedDict
from importlib import resources
from pathlib import Path
from typing import Any

from rlvr.log.sinks import read_jsonl

# (title, patterns): a panel shows every metric whose name matches one of its patterns, in order.
PANELS: list[tuple[str, list[str]]] = [
    ("Reward", [r"^reward$", r"^rewards/[^/]+$", r"^eval/reward$"]),
    ("Accuracy and held-out pass@k", [r"^accuracy$", r"^eval/accuracy$", r"^eval/pass@\d+$"]),
    ("Response length (tokens)", [r"^response_length$", r"^response_length_max$", r"^eval/response_length$"]),
    ("Token entropy", [r"^entropy$"]),
    ("KL and divergence", [r"^kl$", r"^kl_reward$", r"^kl_coef$", r"^divergence$"]),
    ("Clip fractions", [r"clip_fraction", r"^bapo_clip_(low|high)$"]),
    ("Zero-std groups, truncation, masking", [r"^zero_std_fraction$", r"^truncated_fraction$",
                                              r"^trained_fraction$", r"masked_.*fraction$", r"excluded_fraction$",
                                              r"no_verdict_fraction$"]),
    ("Throughput (tokens/s)", [r"^tokens_per_second$"]),
    ("Seconds per step", [r"^(generate|train|step)_seconds$"]),
    ("Optimisation", [r"^grad_norm$", r"^loss$"]),
    ("Episodes: turns and tool use", [r"^env/turns$", r"^env/tool_calls$", r"^env/tool_ok$", r"^env/void$"]),
    ("Episodes: tool errors and endings", [r"^env/tool_error_rate$", r"^env/ending/"]),
]
# Panels drawn in the PNG (the first six that have data).
PNG_PANELS = 6
SKIP = {"step", "epoch"}


def curve_rows(run_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl with the evaluation before training as step 0 and the one after merged into
    the last step (summary.json), so held-out curves span the run."""
    rows = [r for r in read_jsonl(run_dir / "metrics.jsonl") if _is_number(r.get("step"))]
    summary = _summary(run_dir)
    if isinstance(summary.get("eval_before"), dict) and summary["eval_before"]:
        rows.insert(0, {"step": 0, **summary["eval_before"]})
    if isinstance(summary.get("eval_after"), dict) and rows and rows[-1].get("step") == summary.get("steps"):
        rows[-1] = summary["eval_after"] | rows[-1]
    return rows


def _summary(run_dir: Path) -> dict[str, Any]:
    """summary.json, or {} where there is none or it is not a readable JSON object."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def panels(rows: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The configured panels that have data, and every other numeric metric (one chart each)."""
    keys = list(OrderedDict.fromkeys(k for r in rows for k, v in r.items()
                                     if k not in SKIP and (isinstance(v, int | float) or v is None)
                                     and not isinstance(v, bool)))
    # one reward function: rewards/<name> repeats reward unweighted, so it is left to "every other metric"
    parts = [k for k in keys if re.search(r"^rewards/[^/]+$", k)]
    used: set[str] = set()
    if len(parts) == 1:
        keys = [k for k in keys if k != parts[0]] + parts
    out = []
    for title, patterns in PANELS:
        chosen = [k for p in patterns for k in keys if re.search(p, k) and k not in used
                  and not (len(parts) == 1 and k == parts[0])]
        chosen = list(OrderedDict.fromkeys(chosen))
        if any(isinstance(r.get(k), int | float) for r in rows for k in chosen):
            out.append({"title": title, "keys": chosen})
            used.update(chosen)
    other = [k for k in keys if k not in used and any(isinstance(r.get(k), int | float) for r in rows)]
    return out, other


def rollouts(run_dir: Path, max_steps: int) -> tuple[dict[int, list[dict[str, Any]]], str]:
    """samples.jsonl grouped by step, then by prompt; at most ``max_steps`` steps, evenly spaced
    and always with the first and the last (a long run's file would not fit in a page)."""
    by_step: dict[int, OrderedDict[str, dict[str, Any]]] = {}
    for row in read_jsonl(run_dir / "samples.jsonl"):
        groups = by_step.setdefault(int(row["step"]), OrderedDict())
        key = str(row.get("prompt_id") or row.get("prompt"))
        group = groups.setdefault(key, {"id": row.get("prompt_id"), "prompt": row.get("prompt", ""), "samples": []})
        if row.get("images") and "images" not in group:
            group["images"] = _inlined(run_dir, row["images"])
        group["samples"].append({k: row.get(k) for k in ("completion", "reward", "rewards", "advantage",
                                                          "finish_reason", "completion_tokens", "masked")})
    steps = sorted(by_step)
    note = ""
    if len(steps) > max_steps:
        pick = sorted({steps[round(i * (len(steps) - 1) / (max_steps - 1))] for i in range(max_steps)})
        note = (f"{len(pick)} of the {len(steps)} logged steps are in this page, evenly spaced; "
                f"`rlvr report --max-steps N` keeps more.")
        steps = pick
    return {s: list(by_step[s].values()) for s in steps}, note


def _inlined(run_dir: Path, paths: list[str]) -> list[str]:
    """A group's thumbnails (``images/<sha1>.png`` in the run directory, rlvr.train.records) as
    data URIs, so that the report stays one file; a path of any other form, or a missing file,
    is left out (the page never reads outside the run's images folder)."""
    out = []
    for path in paths if isinstance(paths, list) else []:
        if isinstance(path, str) and re.fullmatch(r"images/[0-9a-f]{40}\.png", path) and (run_dir / path).is_file():
            out.append("data:image/png;base64," + base64.b64encode((run_dir / path).read_bytes()).decode("ascii"))
    return out


def facts(run_dir: Path, rows: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The header line: model, algorithm, steps, time, reward and held-out accuracy before → after."""
    import tomllib

    out: list[tuple[str, str]] = []
    config_path = run_dir / "config.toml"
    cfg = tomllib.loads(config_path.read_text()) if config_path.exists() else {}
    if cfg:  # config.toml holds the keys the run set; the others have their defaults
        from rlvr.config import AlgoConfig, RunConfig, TaskConfig

        algo, task = cfg.get("algo", {}), cfg.get("task", {})
        default = {"model": RunConfig.model_fields["model"].default, "task": TaskConfig.model_fields["name"].default,
                   **{k: AlgoConfig.model_fields[k].default for k in ("advantage", "loss")}}
        out += [("model", str(cfg.get("model", default["model"]))),
                ("algorithm", f"{algo.get('advantage', default['advantage'])} + {algo.get('loss', default['loss'])}"),
                ("task", str(task.get("name", default["task"])) if task.get("source", "reasoning_gym") == "reasoning_gym"
                 else str(task.get("source")))]
    trained = [r for r in rows if r.get("step", 0) > 0 and "reward" in r]
    if trained:
        out.append(("steps", str(trained[-1]["step"])))
        seconds = sum(r["step_seconds"] for r in trained if _is_number(r.get("step_seconds")))
        out.append(("time", f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"))
        k = max(1, min(3, len(trained) // 3))
        start = sum(r["reward"] if _is_number(r["reward"]) else 0 for r in trained[:k]) / k
        end = sum(r["reward"] if _is_number(r["reward"]) else 0 for r in trained[-k:]) / k
        out.append(("reward", f"{start:.3f} → {end:.3f}"))
    summary = _summary(run_dir)
    before = (summary.get("eval_before") or {}).get("eval/accuracy")
    after = (summary.get("eval_after") or {}).get("eval/accuracy")
    if _is_number(before):
        out.append(("held-out accuracy", f"{before:.1%} → {after:.1%}" if _is_number(after) else f"{before:.1%} (before)"))
    gain = summary.get("held_out_gain")
    numbers = ("difference", "ci95_low", "ci95_high", "prompts", "se")
    if isinstance(gain, dict) and all(_is_number(gain.get(k)) for k in numbers):  # se None: one prompt
        out.append(("held-out gain, 95% CI", f"{100 * gain['difference']:+.1f} points "
                    f"({100 * gain['ci95_low']:+.1f} to {100 * gain['ci95_high']:+.1f}, {gain['prompts']:.0f} prompts)"))
    return out


def build_data(run_dir: Path, max_steps: int = 60) -> dict[str, Any]:
    rows = curve_rows(run_dir)
    shown, other = panels(rows)
    browser, note = rollouts(run_dir, max_steps)
    config_path = run_dir / "config.toml"
    return {"facts": {"name": run_dir.resolve().name, "items": facts(run_dir, rows)}, "metrics": rows,
            "panels": shown, "other": other, "rollouts": browser, "rollout_note": note,
            "config_text": config_path.read_text() if config_path.exists() else ""}


def write_html(run_dir: str | Path, out: str | Path | None = None, *, max_steps: int = 60) -> Path:
    """Write ``<run>/report.html`` (or ``out``): one file, no network needed to view it."""
    run_dir = Path(run_dir)
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.toml").exists():
        raise FileNotFoundError(f"{run_dir} is not a run directory (no metrics.jsonl or config.toml)")
    if max_steps < 2:
        raise ValueError(f"max_steps must be at least 2, got {max_steps}")
    data = json.dumps(build_data(run_dir, max_steps), allow_nan=False, separators=(",", ":"))
    # no "<" at all inside <script>: nothing a completion contains can end or re-open the element
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    template = resources.files("rlvr").joinpath("assets/report.html").read_text()
    path = Path(out) if out else run_dir / "report.html"
    path.write_text(template.replace("__REPORT_DATA__", data))
    return path


def write_png(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``<run>/curves.png``: the first six panels of the report, for terminals and notebooks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    run_dir = Path(run_dir)
    rows = curve_rows(run_dir)
    shown = panels(rows)[0][:PNG_PANELS]
    if not shown:
        raise ValueError(f"{run_dir} has no metrics to plot yet")
    cols = min(3, len(shown))
    nrows = (len(shown) + cols - 1) // cols
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.9 * nrows), squeeze=False)
    for ax, panel in zip(axes.flat, shown):
        for key in panel["keys"]:
            points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), int | float)]
            if points:
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o" if len(points) <= 2 else None, markersize=3, linewidth=1.4, label=key)
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if len(panel["keys"]) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.set_visible(False)
    fig.suptitle(run_dir.resolve().name, fontsize=11)
    fig.tight_layout()
    path = Path(out) if out else run_dir / "curves.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path, *, max_steps: int = 60, png: bool = True) -> list[Path]:
    """report.html, and curves.png unless ``png`` is False; returns the paths written."""
    paths = [write_html(run_dir, max_steps=max_steps)]
    if png:
        paths.append(write_png(run_dir))
    return paths
