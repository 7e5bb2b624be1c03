"""Scale-out on Ray: rollout workers and data-parallel learners behind the local loop's own step.

    rlvr train dist.rollout_workers=2 dist.learners=2          a local Ray on this machine
    rlvr train dist.address=auto ...                          join a running cluster (ray start)

The driver runs exactly the local loop (`rlvr.train.loop.train_step`); `attach` swaps two of its
parts for actor-backed ones with the same interfaces:

- the engine becomes a `RayEngine` (rlvr.dist.rollout): prompts are shared out to rollout worker
  actors, each with an embedded engine, and every sample keeps the random stream the local
  engine would have given it, so the workers sample what one engine would. After each update
  the learner's weights are put in Ray's object store once and loaded by every worker, and every
  sample carries the version of the weights it was sampled with.
- the update runs data-parallel (rlvr.dist.learners): the driver is rank 0 of a torch.distributed
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

from typing import Any

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


def attach(run: Any) -> None:
    """Swap the run's engine and update for Ray-backed ones, per its config's [dist] section."""
    from rlvr.dist.learners import DataParallel
    from rlvr.dist.rollout import RayEngine
    from rlvr.train.data import make_episodes

    d = run.cfg.dist
    if d.rollout_workers == 0 and d.learners == 1:
        return
    import os

    start_ray(d.address, d.num_cpus or max(os.cpu_count() or 1, d.rollout_workers + d.learners))
    if d.rollout_workers:
        run.engine = RayEngine(run.cfg, run.learner.model, run.tokenizer, workers=d.rollout_workers,
                               timeout_s=d.timeout_s, generator=run.engine.generator)
        run.shared_weights = False
        run.episodes = make_episodes(run.cfg, run.engine, run.tokenizer, run.examples, run.rewards, run.params)
    if d.learners > 1:
        run.data_parallel = DataParallel(run, d.learners, timeout_s=d.timeout_s)


def detach(run: Any) -> None:
    """Stop the run's actors and leave the process group (the end of a run, or a failure)."""
    pipeline = getattr(run, "pipeline", None)
    if pipeline is not None:
        pipeline.close()
        run.pipeline = None
    dp = getattr(run, "data_parallel", None)
    if dp is not None:
        dp.close()
        run.data_parallel = None
    close = getattr(run.engine, "close", None)
    if close is not None:
        close()
