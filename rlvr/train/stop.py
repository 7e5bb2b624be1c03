"""Ctrl-C (or SIGTERM) during training: the first one stops after the current step with a
checkpoint saved."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING, Any

from rlvr.log import ConsoleProgress

if TYPE_CHECKING:
    from rlvr.train.run import Run


class GracefulStop:
    """The first Ctrl-C asks the loop to stop after the current step and save a checkpoint (a step
    is never cut in half, so the saved state resumes exactly); a second Ctrl-C aborts at once."""

    def __init__(self, progress: ConsoleProgress) -> None:
        self.requested, self.progress = False, progress
        self._previous: dict[int, Any] = {}  # the handlers it replaced, by signal

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.progress.print("stopping after this step and saving a checkpoint (Ctrl-C again to abort now)")

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            # SIGTERM (`kill`, a job scheduler's preemption, `docker stop`) asks what Ctrl-C does: it
            # used to end the run at once with nothing saved since the last checkpoint
            self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Interrupted(KeyboardInterrupt):
    """Training stopped on request after a checkpoint was saved."""


def stop_if_requested(run: Run, step: int, stop: GracefulStop, progress: ConsoleProgress) -> None:
    """After a step: on a first Ctrl-C, save it and stop, saying how to resume."""
    from rlvr.train.run import save

    if stop.requested:
        save(run, step)
        progress.print(f"stopped: saved step {step}; resume with `rlvr {run.command} --resume {run.dir}`")
        raise Interrupted
