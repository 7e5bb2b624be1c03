"""Scale-out on Ray: rollout workers and data-parallel learners behind the local loop's own step.

    rlvr train dist.rollout_workers=2 dist.learners=2          a local Ray on this machine
    rlvr train dist.ray.address=auto ...                      join a running cluster (ray start)

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
`dist.ray.timeout_s` fails with an error naming what it waited for, never hangs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlvr.scaleout.cluster import INSTALL_HINT, placement, require_ray, start_ray  # noqa: F401  (the package's API)

if TYPE_CHECKING:
    from rlvr.train.run import Run

def attach(run: Run) -> None:
    """Swap the run's parts for Ray-backed ones, per its config's [dist] section: the engine for
    rollout workers, the updater for data-parallel learners, the rollouts for the asynchronous
    pipeline."""
    from rlvr.scaleout.learners import DataParallel
    from rlvr.scaleout.pipeline import AsyncRollouts
    from rlvr.scaleout.rollout import RayEngine
    from rlvr.train.methods.base import example_fields, fields_by_id

    d = run.cfg.dist
    sharded = d.sharding == "fsdp"
    if d.rollout_workers == 0 and d.learners == 1 and not sharded:
        return
    import math
    import os

    r, a = d.ray_options(), d.async_options()
    if (d.learners > 1 or sharded) and run.processor is not None:
        raise ValueError("dist.learners > 1 does not train vision-language models yet: unset dist.learners "
                         "(rollout workers do sample them)")
    # every actor reserves cpus_per_worker: a local Ray needs that many, or its actors never start
    # (sharded learners are all actors; replicated ones, all but this process)
    actors = (d.rollout_workers + d.learners - (0 if sharded else 1)) * r.cpus_per_worker
    start_ray(r.address, r.num_cpus or max(os.cpu_count() or 1, math.ceil(actors)))
    if d.rollout_workers:
        run.engine = RayEngine(run.cfg, run.learner.model, run.tokenizer, workers=d.rollout_workers,
                               timeout_s=r.timeout_s, generator=run.engine.generator, version=run.policy_version)
        run.updater.shared_weights = False
    if sharded:
        from rlvr.scaleout.sharded import ShardedLearners

        run.updater = ShardedLearners(run.cfg, run.updater, d.learners, timeout_s=r.timeout_s, checkpoint=run.checkpoint,
                                      fields_of=example_fields(fields_by_id(run.task.examples)))
    elif d.learners > 1:
        run.updater = DataParallel(run.cfg, run.updater, d.learners, timeout_s=r.timeout_s,
                                   fields_of=example_fields(fields_by_id(run.task.examples)))
    if a is not None:
        lookahead = min(a.steps, a.max_staleness) if a.on_stale == "wait" else a.steps
        run.rollouts = AsyncRollouts(run, lookahead=lookahead, last_step=run.cfg.train.steps,
                                     max_staleness=a.max_staleness, drop_stale=a.on_stale == "drop")


def detach(run: Run) -> None:
    """Stop the run's actors and leave the process group (the end of a run, or a failure)."""
    run.rollouts.close()
    run.updater.close()
    run.engine.close()
