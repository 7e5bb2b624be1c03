"""The asynchronous pipeline: generation runs ahead of training, under a staleness bound.

With ``dist.async_rollouts = {steps = D}``, the rollouts of step k + 1 ... k + D are generated while
step k trains: one background thread runs the step's whole collection (prompt sampling,
generation, rewards, rollout strategy), in step order. The weights a sample was generated with
are its version (`Completion.policy_version`); at training time the learner is at version k − 1,
so a sample's staleness is k − 1 − version.

- ``on_stale = "wait"`` (default): generation never runs more than ``max_staleness``
  steps ahead (the lookahead is min(D, max_staleness)), so no sample is ever staler than the
  bound; the pipeline waits instead.
- ``on_stale = "drop"``: generation runs D steps ahead, and a group with a sample staler
  than ``max_staleness`` is dropped at training time (counted in ``dist/stale_dropped``).

Stale groups are trained off-policy: the PPO ratio is taken against the engine's own sampling
log-probs (as for rollout replay), and any `algo.offpolicy` correction applies on top.

The sampler and the replay buffer are touched by the background thread only: the observation
of step k's groups is queued behind the collections already started, so every run sees the
same order of sampling and observing (the sampler learns of a step D steps later). Checkpoints
and evaluations wait for the queue to drain. A checkpoint at step k keeps the collections made
ahead for steps k + 1 ... (their groups as sampled, from the older weights a straight run trains
them with) and the state after them and after step k's observation (sampler, replay buffer, the
engine's stream): a resumed run trains those collections as they were and makes the next one
from where the straight run made it, so asynchronous runs resume bit for bit (tested; a run
killed with its buffer full, bench/kill_resume.py). Checkpoints of rlvr 0.2.0 kept the state the
next collection began from instead; they still load, and their resumed runs collect those steps
again from the same prompts, on the resumed policy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from rlvr.train.collect import Collected, Rollouts
from rlvr.train.run import collect
from rlvr.types import Group, oldest_version

if TYPE_CHECKING:
    from rlvr.train.run import Run


class Pipeline:
    """Collections for the coming steps, run ahead in step order on one background thread."""

    def __init__(self, collect: Callable[[int], Any], *, lookahead: int, last_step: int) -> None:
        if lookahead < 1:
            raise ValueError(f"the pipeline needs a lookahead >= 1, got {lookahead}")
        self.collect, self.lookahead, self.last_step = collect, lookahead, last_step
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlvr-rollouts")
        self.pending: dict[int, Future[Any]] = {}
        self.queued = 0
        """The highest step whose collection was queued."""
        self.error: BaseException | None = None
        self.following: dict[int, list[tuple[Callable[..., Any], tuple[Any, ...]]]] = {}
        """Work to queue right behind a step's collection when it is queued (`after_collection`)."""

    def take(self, step: int) -> Any:
        """Step's collection (queued now if it was not), after queueing the ones ahead of it."""
        self._raise()
        for ahead in range(max(step, self.queued + 1), min(step + self.lookahead, self.last_step) + 1):
            self._queue(ahead)
        if step not in self.pending:  # a step the queue never reached
            self._queue(step)
        return self.pending.pop(step).result()

    def _queue(self, step: int) -> None:
        self.pending[step] = self.executor.submit(self.collect, step)
        self.queued = max(self.queued, step)
        for fn, args in self.following.pop(step, []):
            self.after(fn, *args)

    def after_collection(self, step: int, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the background thread right after step's collection, once that is
        queued (a resumed run's observations, in the order the run it resumes made them)."""
        self.following.setdefault(step, []).append((fn, args))

    def after(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the background thread, after every collection queued so far; an
        error it raises is raised again by the next take or drain."""
        def run() -> None:
            try:
                fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the main thread
                self.error = err

        self.executor.submit(run)

    def drain(self) -> None:
        """Wait until the background thread is idle (collections already queued stay ready)."""
        self.executor.submit(lambda: None).result()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        for f in self.pending.values():
            f.cancel()
        # not waiting: after an error or a second Ctrl-C, a collection under way would hold the run for
        # minutes; the workers are stopped next (rlvr.scaleout.detach), which ends it
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.pending.clear()


class AsyncRollouts(Rollouts):
    """`Rollouts` with the collections run ahead on the pipeline's thread (see module docstring)."""

    def __init__(self, run: Run, *, lookahead: int, last_step: int, max_staleness: int, drop_stale: bool) -> None:
        super().__init__(run.rollouts.sampler, run.rollouts.replay)
        self.pipeline = Pipeline(lambda step: collect(run, step), lookahead=lookahead, last_step=last_step)
        self.run = run
        self.max_staleness, self.drop_stale = max_staleness, drop_stale
        self.taken = 0
        """The last step taken: a checkpoint saved now is this step's."""
        for x in run.rollouts.pending:  # resumed from rlvr 0.2.0: made where the run it resumes made them
            self.pipeline.after_collection(x.after, Rollouts.observe, self, x.own, x.aside, x.step)
        run.rollouts.pending = []
        for step, made in sorted(run.rollouts.ahead.items()):  # resumed: the collections its checkpoint carried
            done: Future[Any] = Future()
            done.set_result(made)
            self.pipeline.pending[step] = done
            self.pipeline.queued = max(self.pipeline.queued, step)
        run.rollouts.ahead = {}

    def take(self, step: int, make: Callable[[int], Collected]) -> Collected:
        """Step's collection, made while earlier steps trained. Groups with a sample from older
        weights are trained against their sampling log-probs ("stale"); with on_stale = "drop"
        (dist.async_rollouts), groups staler than max_staleness are set aside, untrained."""
        run = self.run  # the pipeline made this collection ahead, on its thread; `make` is the synchronous path's
        collected: Collected = self.pipeline.take(step)
        self.taken = step
        serving = run.engine.version or 0  # the weights' version before this step's update
        gathered, kept, dropped = collected.gathered, [], 0
        for g in gathered.train:
            oldest = oldest_version(g.samples)
            staleness = 0 if oldest is None else serving - oldest
            if staleness > self.max_staleness and self.drop_stale:
                dropped += 1
                gathered.aside.append(g)  # not trained on; the sampler still observes it
                continue
            kept.append(dataclasses.replace(g, staleness=staleness) if staleness > 0 else g)
        gathered.train = kept
        # generate_seconds is then the wait for rollouts made during earlier updates
        collected.metrics |= {"dist/stale_dropped": float(dropped), "dist/rollout_seconds": collected.seconds}
        return collected

    def observe(self, own: list[Group], aside: list[Group], step: int) -> None:
        """On the pipeline's thread, after the collections already under way."""
        self.pipeline.after(super().observe, own, aside, step)

    def state_dict(self) -> dict[str, Any]:
        """For a checkpoint after step `taken` (the pipeline drained, so every collection queued is
        made and every observation queued is made): the collections made ahead, and the state
        after them, where the next collection begins (see the module docstring)."""
        ahead = {step: made.result().state() for step, made in sorted(self.pipeline.pending.items())
                 if step > self.taken}
        return super().state_dict() | ({"ahead": ahead} if ahead else {})

    def drain(self) -> None:
        self.pipeline.drain()

    def close(self) -> None:
        self.pipeline.close()
