"""Progress bars of the commands that score many prompts (`rlvr filter`, `rlvr contamination`)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


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
