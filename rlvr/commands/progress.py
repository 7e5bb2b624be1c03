"""Progress of the commands that score many prompts (`rlvr filter`, `rlvr contamination`, `rlvr eval`)."""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from rlvr.log.sinks import elapsed_line


@contextlib.contextmanager
def counting(totals: dict[str, int]) -> Iterator[Callable[[str, int], None]]:
    """Progress bars on stderr, one per name, advanced by ``advance(name, k)``; where stderr is not a
    terminal (a log file), one "name: done/total" line per advance instead."""
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not console.is_terminal) as bar:
        tasks = {name: bar.add_task(name, total=total) for name, total in totals.items()}

        def advance(name: str, k: int) -> None:
            bar.advance(tasks[name], k)
            if not console.is_terminal:
                print(f"{name}: {int(bar.tasks[tasks[name]].completed)}/{totals[name]}", file=sys.stderr, flush=True)

        yield advance


class Stages:
    """What a long command is doing, on stderr: a bar on a terminal; where stderr is not one (a
    log file, a pipe), a line per stage and its count at most every `every` seconds, each with
    the seconds since the command began, so a log shows it is alive."""

    def __init__(self, label: str, every: float = 10.0) -> None:
        self.console = Console(stderr=True)
        self.label, self.every = label, every
        self.began = self.said = time.perf_counter()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=self.console, disable=not self.console.is_terminal, transient=True)
        self.task: Any = None

    def __enter__(self) -> Stages:
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def stage(self, text: str, total: int | None = None) -> None:
        """A new stage: `text`, with `total` things to count (`advance`) or none."""
        if self.task is not None:
            self.bar.remove_task(self.task)
        self.task = self.bar.add_task(f"{self.label}: {text}", total=total)
        self._line(text)

    def advance(self, k: int) -> None:
        self.bar.advance(self.task, k)
        task = next(t for t in self.bar.tasks if t.id == self.task)
        if time.perf_counter() - self.said >= self.every or task.completed == task.total:
            self._line(f"{task.description.split(': ', 1)[-1]}: {int(task.completed)}/{int(task.total or 0)}")

    def _line(self, text: str) -> None:
        self.said = time.perf_counter()
        if not self.console.is_terminal:
            elapsed_line(self.console, self.began, self.label, text)
