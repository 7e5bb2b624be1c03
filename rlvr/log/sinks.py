"""Metric sinks: an append-only JSONL file (flushed per row) and a rich progress display."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; None marks a non-finite value
    return value


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of a JSONL file; a missing file is empty, a half-written last line (a run writing it
    right now) is ignored, and a broken line elsewhere is an error naming it."""
    if not path.exists():
        return []
    rows = []
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not valid JSON") from None
    return rows


class JsonlSink:
    """Appends one JSON object per line and flushes it, so a crash loses nothing written."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a")

    def write(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


# metric key → (label, format) shown live in the terminal
LIVE = {"reward": ("reward", "{:.3f}"), "accuracy": ("acc", "{:.2f}"), "response_length": ("len", "{:.0f}"),
        "zero_std_fraction": ("0-std", "{:.2f}"), "step_seconds": ("s/step", "{:.1f}")}


ROUTINE = frozenset({"generating", "training"})
"""A step's own statuses: where the output is a file, the step's line says they happened."""


class ConsoleProgress:
    """A progress bar over training steps with live key metrics; plain lines when not a terminal."""

    def __init__(self, total: int, start: int = 0, console: Console | None = None, *,
                 live: dict[str, tuple[str, str]] | None = None, label: str = "train",
                 began: float | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.live = self.console.is_terminal
        self.began = time.perf_counter() if began is None else began
        self.label, self.said, self.stepped = label, ("", 0.0), False
        """Where the output is not a terminal: the last status line and when it was written, and
        whether a step line has been (`status`)."""
        self.shown = LIVE if live is None else live
        self.done, self.doing = start, ""
        """The last step finished, and what the run does now (the last status shown): what an
        error that stops the run says it stopped in (rlvr.train.stop.resumable)."""
        self.progress = Progress(
            TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[metrics]}"),
            TextColumn("[dim]{task.fields[status]}"),
            console=self.console, disable=not self.live,
        )
        self.task = self.progress.add_task("train", total=total, completed=start, metrics="", status="")

    def __enter__(self) -> ConsoleProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)

    def status(self, text: str) -> None:
        """What the run does now: beside the bar on a terminal. Where the output is a file, a line
        with the seconds since the command began: every status until the first step's line, after
        it only those that are not a step's own (generating, training), and a repeated kind of
        status (a count: "reference log-probs 3/10 pairs") at most every 10 s."""
        self.doing = text
        self.progress.update(self.task, status=text)
        if self.live or not text or (self.stepped and text in ROUTINE):
            return
        last, when = self.said
        now = time.perf_counter()
        if text != last and (text.split()[0] != last.split(" ", 1)[0] or now - when >= 10.0):
            self.said = (text, now)
            elapsed_line(self.console, self.began, self.label, text)

    def step(self, step: int, metrics: dict[str, Any]) -> None:
        self.done, self.doing, self.stepped = step, "", True
        shown = "  ".join(label + " " + fmt.format(metrics[k]) for k, (label, fmt) in self.shown.items() if k in metrics)
        self.progress.update(self.task, completed=step, metrics=shown, status="")
        if not self.live:
            self.console.print(f"step {step}  {shown}", highlight=False)

    def print(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)


def elapsed_line(console: Console, began: float, label: str, text: str) -> None:
    """What a command does, as one line of a log (where the output is not a terminal): the
    seconds since it began, its name and `text`, unwrapped."""
    console.print(f"[{time.perf_counter() - began:6.1f}s] {label}: {text}", highlight=False, markup=False,
                  soft_wrap=True)


def setting_up(began: float, label: str = "train") -> None:
    """Where stderr is not a terminal, say that the command is setting up (loading the model, the
    task and the engine can take a minute, and a log file would otherwise show nothing)."""
    console = Console(stderr=True)
    if not console.is_terminal:
        elapsed_line(console, began, label, "setting up (the model, the task, the engine)")


class ScreeningProgress:
    """A progress bar over the prompts the initial policy is screened on (algo.divergence's
    rehearsal set); a start and an end line when not a terminal; nothing when disabled."""

    def __init__(self, prompts: int, k: int, disable: bool = False, console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.disable, self.prompts, self.k = disable, prompts, k
        self.progress = Progress(TextColumn("[bold]screening"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=self.console,
                                 disable=disable or not self.console.is_terminal)
        self.task = self.progress.add_task("screening", total=prompts)

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def report(self, kept: int, needed: int) -> None:
        if not self.disable:
            self.console.print(f"rehearsal set: {kept} of {self.prompts} prompts solved at least {needed}/{self.k} times")

    def __enter__(self) -> ScreeningProgress:
        if not self.disable:
            self.console.print(f"rehearsal set: sampling {self.prompts} prompts × {self.k} with the initial policy")
        self.progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.__exit__(*exc)
