"""Errors that say whose fault a failure is (a leaf: any layer raises them, and `rlvr`'s main reports
them without importing the part that raised)."""

from __future__ import annotations


class InfrastructureError(RuntimeError):
    """A verdict could not be reached for reasons that are not the completion's: a sandbox that
    could not start the program, a judge service that is down. Raise it from a reward (or return
    an instance in a group reward's list) and the sample is counted as ``<name>/error`` and
    excluded from the update, never scored 0; with ``on_reward_error = "stop"`` the run stops."""


class RunDirError(RuntimeError):
    """A run directory cannot be used as asked (it exists already, has nothing to resume, or lacks
    what a resumed method needs)."""


class EngineOutOfMemory(RuntimeError):
    """The rollout engine ran out of memory while it sampled; the message says how much it was
    asked for and which settings shrink it. The run stops (its checkpoints intact) rather than
    train on a step that lost its samples."""


class WeightSyncError(RuntimeError):
    """New weights did not reach a rollout engine that holds its own copy of them: some of its
    parameters received none, or the probe after the update (rlvr.rollout.probe) found the engine
    computing other log-probabilities than the learner. The run stops rather than sample from a
    policy it is no longer training."""


class MissingExtra(ImportError):
    """An optional package the config asks for is not installed; the message names the extra."""


class SandboxUnavailable(RuntimeError):
    """No isolation could be set up; the message says how to fix it."""
