"""What a run writes besides metrics: a row per sample (samples.jsonl), the summary, the report."""

from __future__ import annotations

import hashlib
import io
import statistics
from collections import deque
from pathlib import Path
from typing import Any

from rlvr import report
from rlvr.eval.metrics import paired_difference
from rlvr.log import ConsoleProgress
from rlvr.log.sinks import read_jsonl
from rlvr.types import Group, PromptMedia

THUMBNAIL_SIDE = 128
"""The longest side of the prompt images the report shows (pixels)."""


class Thumbnails:
    """Writes each prompt image once, shrunk to a thumbnail, as ``<run>/images/<sha1>.png``, and
    names it for samples.jsonl (the report's rollout browser shows them beside their group)."""

    def __init__(self, run_dir: Path) -> None:
        self.dir = run_dir / "images"
        self._known: dict[int, tuple[PromptMedia, list[str]]] = {}

    def __call__(self, media: PromptMedia) -> list[str]:
        known = self._known.get(id(media))
        if known is not None and known[0] is media:
            return known[1]
        paths = [self._write(image) for image in media.images]
        self._known[id(media)] = (media, paths)
        return paths

    def _write(self, image: Any) -> str:
        small = image.copy()
        small.thumbnail((THUMBNAIL_SIDE, THUMBNAIL_SIDE))
        data = io.BytesIO()
        small.save(data, format="PNG")
        name = f"{hashlib.sha1(data.getvalue()).hexdigest()}.png"
        path = self.dir / name
        if not path.exists():
            self.dir.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data.getvalue())
        return f"images/{name}"


def sample_rows(step: int, groups: list[Group], thumbnails: Thumbnails | None = None) -> list[dict[str, Any]]:
    """One row per sample; "advantage" is what update_policy used (the token mean for gae).
    "masked" lists [start, end, reason] character spans of the completion whose tokens had loss
    mask 0 (today a whole completion: a reward excluded it, or it was truncated under
    algo.mask_truncated); the report's rollout browser marks them. A prompt with images gets
    "images", its thumbnails' paths in the run directory (written by ``thumbnails``)."""
    rows = []
    for g in groups:
        media = g.samples[0].media if g.samples else None
        images = {"images": thumbnails(media)} if thumbnails is not None and media is not None else {}
        reasons = g.masked or [None] * len(g.samples)
        injected = g.metadata.get("injected_spans") or [[] for _ in g.samples]
        texts = g.metadata.get("texts") or [s.completion.text for s in g.samples]  # an episode: all its segments
        for k, s in enumerate(g.samples):
            rows.append({
                "step": step, "prompt_id": g.metadata.get("id"), "prompt": g.prompt, "completion": texts[k],
                "reward": s.reward, "rewards": s.reward_parts,
                "advantage": None if g.advantages is None else g.advantages[k],
                "finish_reason": s.completion.finish_reason, "completion_tokens": len(s.completion.token_ids),
                "masked": [[0, len(texts[k]), reasons[k]]] if reasons[k] else
                [[a, b, "injected"] for a, b in injected[k]],
                **({"policy_version": s.completion.policy_version} if s.completion.policy_version is not None else {}),
                **({"swapped_at": list(s.completion.swapped_at)} if s.completion.swapped_at else {}),
                **({"expert": True} if s.off_policy else {}), **images})
    return rows


def write_report(run_dir: Path, progress: ConsoleProgress) -> None:
    """report.html and curves.png; a failure is reported, never fatal (the run's files are complete)."""
    try:
        paths = report.write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded
        progress.print(f"could not write the report ({type(e).__name__}: {e}); try `rlvr report {run_dir}`")
        return
    progress.print("report: " + "  ".join(str(p) for p in paths))


def summarise(metrics_path: Path, run_dir: Path) -> dict[str, Any]:
    """The run's totals from metrics.jsonl: its last step, the seconds of its steps, and the mean
    reward of its first and last steps. Any field may be absent from any row (a step whose samples
    all lacked a verdict has no reward): a total is over the rows that have it, or left out."""
    rows = read_jsonl(metrics_path)
    if not rows:
        return {"run_dir": str(run_dir), "steps": 0}
    steps = [r["step"] for r in rows if is_number(r.get("step"))]
    out: dict[str, Any] = {"run_dir": str(run_dir), "steps": int(max(steps, default=0)),
                           "seconds": sum(r["step_seconds"] for r in rows if is_number(r.get("step_seconds")))}
    rewarded = [r["reward"] for r in rows if is_number(r.get("reward"))]
    if rewarded:
        k = max(1, min(3, len(rewarded) // 3))  # compare the mean of the first and last k steps
        out |= {"reward_start": sum(rewarded[:k]) / k, "reward_end": sum(rewarded[-k:]) / k}
    return out


def is_number(value: Any) -> bool:
    """Whether a logged value is a number that can be printed as one (not None, a bool or a string)."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def held_out_gain(summary: dict[str, Any]) -> dict[str, float | None] | None:
    """The held-out accuracy's change from before training to after, paired by prompt id
    (rlvr.eval.metrics.paired_difference: the mean difference, its standard error and 95%
    interval over the prompts judged both times), from the greedy outcomes the evaluations kept
    (`held_out_before`, `held_out_after`, by example id); None without both, without a prompt
    judged both times, or where accuracy says nothing (`accuracy_is_silent`)."""
    before, after = summary.get("held_out_before"), summary.get("held_out_after")
    if not isinstance(before, dict) or not isinstance(after, dict) or accuracy_is_silent(summary):
        return None
    both = [key for key, b in before.items() if b is not None and after.get(key) is not None]
    if not both:
        return None
    return paired_difference({key: before[key] for key in both}, {key: after[key] for key in both})


def with_held_out_gain(summary: dict[str, Any]) -> dict[str, Any]:
    """``summary`` with its `held_out_gain`, or without one where none can be computed now (a
    gain an earlier finish wrote is never left standing)."""
    summary.pop("held_out_gain", None)
    gain = held_out_gain(summary)
    return summary if gain is None else summary | {"held_out_gain": gain}


def accuracy_is_silent(summary: dict[str, Any]) -> bool:
    """Held-out accuracy 0 before and after with a mean reward beside both: a reward that is not
    pass/fail (RLP's information gain), whose mean says more than accuracy or its gain."""
    before, after = _section(summary, "eval_before"), _section(summary, "eval_after")
    return (before.get("eval/accuracy") == after.get("eval/accuracy") == 0
            and is_number(before.get("eval/reward")) and is_number(after.get("eval/reward")))


def _section(summary: dict[str, Any], key: str) -> dict[str, Any]:
    value = summary.get(key)
    return value if isinstance(value, dict) else {}


def summary_line(summary: dict[str, Any]) -> str:
    """The one-line result: reward at start → end, held-out accuracy before → after, where the run
    is. Every part is printed only where its numbers are there: a summary missing any of them (an
    evaluation whose samples all lacked a verdict has no eval/reward) still gives a line."""
    parts = []
    for label, start, end in (("reward", "reward_start", "reward_end"), ("loss", "loss_start", "loss_end")):
        if is_number(summary.get(start)) and is_number(summary.get(end)):  # loss: rlvr sft, rlvr dpo
            parts.append(f"{label} {summary[start]:.3f} → {summary[end]:.3f}")
    before, after = _section(summary, "eval_before"), _section(summary, "eval_after")
    if accuracy_is_silent(summary):
        parts.append(f"held-out reward {before['eval/reward']:.3f} → {after['eval/reward']:.3f}")
    elif is_number(before.get("eval/accuracy")) and is_number(after.get("eval/accuracy")):
        gain = summary.get("held_out_gain")
        numbers = ("difference", "ci95_low", "ci95_high", "prompts", "se")
        interval = "" if not isinstance(gain, dict) or not all(is_number(gain.get(k)) for k in numbers) else (
            f" ({100 * gain['difference']:+.1f} points, 95% CI {100 * gain['ci95_low']:+.1f} to "
            f"{100 * gain['ci95_high']:+.1f} over {gain['prompts']:.0f} prompts)")  # se None: one prompt, no interval
        parts.append(f"held-out accuracy {before['eval/accuracy']:.1%} → {after['eval/accuracy']:.1%}{interval}")
    elif is_number(before.get("eval/accuracy")):  # no answer judged after training
        parts.append(f"held-out accuracy {before['eval/accuracy']:.1%} → none judged")
    steps, seconds = summary.get("steps"), summary.get("seconds")
    parts.append(f"{steps if is_number(steps) else 0} steps in {seconds if is_number(seconds) else 0:.0f}s")
    parts.append(f"run: {summary.get('run_dir')}")
    return "done: " + " | ".join(parts)


class SignalWatch:
    """Says once, in the run's output, when most groups have carried no learning signal: over the
    last ``window`` steps at least ``threshold`` of the groups had all their rewards equal
    (``zero_std_fraction``). It names the cause the step's metrics show, none of a group's samples
    right (``unsolved_fraction``: the task is too hard for the model as it is) or all of them
    (``solved_fraction``: too easy), and where to read what helps. On the bundled model and
    3-term chain_sum, 76-88% of groups were unsolved and GRPO learned nothing (docs/LOG.md)."""

    def __init__(self, window: int = 10, threshold: float = 0.75, expert_mode: str | None = None) -> None:
        self.rows: deque[tuple[float, float, float]] = deque(maxlen=window)
        self.threshold = threshold
        self.expert_mode = expert_mode  # the run's expert.mode: it already learns from demonstrations
        self.said: set[str] = set()

    def observe(self, metrics: dict[str, Any]) -> str | None:
        """A step's metrics in; the sentence to show, the first time a cause holds, else None."""
        if not all(k in metrics for k in ("zero_std_fraction", "unsolved_fraction", "solved_fraction")):
            return None  # a skipped step, or no verdicts
        self.rows.append((metrics["zero_std_fraction"], metrics["unsolved_fraction"], metrics["solved_fraction"]))
        if len(self.rows) < (self.rows.maxlen or 0):
            return None
        flat, unsolved, solved = (statistics.fmean(column) for column in zip(*self.rows))
        if flat < self.threshold:
            return None
        cause = "hard" if unsolved >= solved else "easy"
        if cause in self.said:
            return None
        self.said.add(cause)
        steps = len(self.rows)
        if cause == "hard":
            said = (f"no signal: over the last {steps} steps {flat:.0%} of the groups had all rewards equal, "
                    f"{unsolved:.0%} with no sample right. The task is too hard for the model as it is, and "
                    "group-relative methods learn nothing from such groups. ")
            if self.expert_mode:
                return said + (f"This run learns from demonstrations (expert.mode = \"{self.expert_mode}\"); "
                               "docs/sampling.md (\"When nothing learns\") compares the ways to use them.")
            return said + ("What gave a model the missing skill on such a task was its reference answers: an SFT "
                           "warm start on them (`rlvr sft` with sft.task_examples, then train from that run; "
                           "configs/hard_sum_sft.toml), or expert.mode = \"warm_start\" in one run; docs/sampling.md "
                           "(\"When nothing learns\") has the measurements.")
        return (f"no signal: over the last {steps} steps {flat:.0%} of the groups had all rewards equal, "
                f"{solved:.0%} with every sample right. The task is too easy for the model now; harder prompts "
                "(`rlvr filter`, a curriculum: docs/sampling.md) give more to learn from.")
