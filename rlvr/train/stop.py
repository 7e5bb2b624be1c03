"""Ctrl-C (or SIGTERM) during training: the first one stops after the current step with a
checkpoint saved; and any other way a run stops early says where it can resume from."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rlvr.log import ConsoleProgress
from rlvr.train import checkpoint as ckpt

if TYPE_CHECKING:
    from rlvr.train.run import Run


class GracefulStop:
    """The first Ctrl-C asks the loop to stop after the current step and save a checkpoint (a step
    is never cut in half, so the saved state resumes exactly); a second Ctrl-C aborts at once."""

    def __init__(self, progress: ConsoleProgress) -> None:
        self.requested, self.progress = False, progress
        self.finishing = False
        """Set once the last step's checkpoint is saved (the final evaluation runs): there is no
        step left to stop after."""
        self._previous: dict[int, Any] = {}  # the handlers it replaced, by signal

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.finishing:
            self.progress.print("training is done and its last checkpoint saved; finishing the final evaluation "
                                "(Ctrl-C again to stop now: a resume finishes it)")
        else:
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
    from rlvr.train.setup import save

    if stop.requested:
        save(run, step)
        progress.print(f"stopped: saved step {step}; resume with `rlvr {run.command} --resume {run.dir}`")
        raise Interrupted


@contextmanager
def resumable(run: Run, progress: ConsoleProgress) -> Iterator[None]:
    """An error that stops the run (anything but a graceful stop: a failing component, a second
    Ctrl-C, a kill signal Python sees) leaves with a note saying what the run was doing, its
    newest complete checkpoint and the command that resumes from it (`resume_note`), printed
    under the traceback, or by `rlvr` beside its own one-line error."""
    try:
        yield
    except Interrupted:
        raise
    except (Exception, KeyboardInterrupt) as err:
        if "--resume" not in str(err) and not any("--resume" in n for n in getattr(err, "__notes__", ())):
            err.add_note(resume_note(run, progress))
        raise


def resume_note(run: Run, progress: ConsoleProgress) -> str:
    """Where a run that stopped early can go on from, and how."""
    doing = f" ({progress.doing})" if progress.doing else ""
    where = f"the run stopped in step {progress.done + 1}{doing}"
    if progress.doing == "evaluating (after)":
        where = f"the run stopped in its final evaluation, after step {progress.done}"
    command = f"`rlvr {run.command} --resume {run.dir}`"
    last = ckpt.latest_checkpoint(run.dir)
    if last is None:
        return f"{where}, before its first checkpoint: {command} starts it again from step 0"
    return f"{where}; its newest complete checkpoint is {last.name}: resume with {command}"
