"""Scale-out on Ray: rollout workers and data-parallel learners behind the local loop's own step.

    rlvr train dist.rollout_workers=2 dist.learners=2          a local Ray on this machine
    rlvr train dist.address=auto ...                          join a running cluster (ray start)

The driver runs exactly the local loop (`rlvr.train.loop.train_step`); `attach` swaps two of its
parts for actor-backed ones with the same interfaces:

- the engine becomes a `RayEngine` (rlvr.scaleout.rollout): prompts are shared out to rollout worker
  actors, each with an embedded engine, and every sample keeps the random stream the local
  engine would have given it, so the workers sample what one engine would. After each update
  the learner's weights are put in Ray's object store once and loaded by every worker, and every
  sample carries the version of the weights it was sampled with.
- the update runs data-parallel (rlvr.scaleout.learners): the driver is rank 0 of a torch.distributed
  group (gloo on CPU, NCCL on GPU) and `dist.learners - 1` learner actors are the other ranks.
  Every rank runs the same `update_policy` on the same groups and takes its share of the
  micro-batches; gradients are summed before each optimizer step (rlvr.train.parallel), which
  is exactly the single-learner gradient. The driver's model stays the policy of record
  (checkpoints, evaluation, weight broadcast).

Faults: a rollout worker that dies has its prompts re-run on a restarted worker with the same
seeds, so the step's samples are the ones it would have had; the restart is logged
(`dist/worker_restarts`). A weight broadcast or an update that does not complete within
`dist.timeout_s` fails with an error naming what it waited for, never hangs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlvr.train.run import Run

INSTALL_HINT = "pip install 'rlvr[ray]'"


def require_ray() -> Any:
    from rlvr.log.tracking import import_extra

    return import_extra("ray", f"dist.rollout_workers / dist.learners need Ray: {INSTALL_HINT}")


def start_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Ray, started locally (address None) or joined (an address, or "auto" for `ray start`'s)."""
    ray = require_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": num_cpus}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    return ray


def attach(run: Run) -> None:
    """Swap the run's parts for Ray-backed ones, per its config's [dist] section: the engine for
    rollout workers, the updater for data-parallel learners, the rollouts for the asynchronous
    pipeline."""
    from rlvr.scaleout.learners import DataParallel
    from rlvr.scaleout.pipeline import AsyncRollouts
    from rlvr.scaleout.rollout import RayEngine

    d = run.cfg.dist
    if d.rollout_workers == 0 and d.learners == 1:
        return
    import os

    start_ray(d.address, d.num_cpus or max(os.cpu_count() or 1, d.rollout_workers + d.learners))
    if d.rollout_workers:
        run.engine = RayEngine(run.cfg, run.learner.model, run.tokenizer, workers=d.rollout_workers,
                               timeout_s=d.timeout_s, generator=run.engine.generator)
        run.updater.shared_weights = False
    if d.learners > 1:
        run.updater = DataParallel(run.cfg, run.updater, d.learners, timeout_s=d.timeout_s)
    if d.async_steps:
        lookahead = min(d.async_steps, d.max_staleness) if d.on_stale == "wait" else d.async_steps
        run.rollouts = AsyncRollouts(run, lookahead=lookahead, last_step=run.cfg.train.steps,
                                     max_staleness=d.max_staleness, drop_stale=d.on_stale == "drop")


def detach(run: Run) -> None:
    """Stop the run's actors and leave the process group (the end of a run, or a failure)."""
    run.rollouts.close()
    run.updater.close()
    run.engine.close()
