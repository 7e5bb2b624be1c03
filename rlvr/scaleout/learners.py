"""Data-parallel learners: the driver is rank 0 of a torch.distributed group, Ray actors the rest.

Every rank runs `update_policy` on the same groups with the same random state, and takes its share
of the micro-batches; gradients and metric sums are reduced before each optimizer step
(rlvr.train.parallel). The gradient is the single learner's on the whole batch, so the replicas
stay identical and the driver's model remains the policy of record.
"""

from __future__ import annotations

import dataclasses
import datetime
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from rlvr.models import load_tokenizer, resolve_device, resolve_dtype
from rlvr.rollout.numerics import Numerics, current, follow
from rlvr.scaleout.cluster import placement, require_ray
from rlvr.train.methods.base import Extras, RankInfo, example_fields
from rlvr.train.parts import learner_rank
from rlvr.train.update import UpdateResult, UpdateSettings, update_policy
from rlvr.train.updater import Updater
from rlvr.types import Group


def backend(cfg: Any) -> str:
    """torch.distributed's backend for the learners: NCCL when they train on GPUs, gloo on CPUs."""
    return "nccl" if resolve_device(cfg.train.device).type == "cuda" else "gloo"


def _on_cpu(state: Any) -> Any:
    """A state dict with every tensor detached on the CPU (to send to other processes)."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu()
    if isinstance(state, dict):
        return {k: _on_cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_on_cpu(v) for v in state)
    return state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


class RankActor:
    """What every learner rank's actor does alike, replicated (`LearnerWorker`) or sharded
    (rlvr.scaleout.sharded.ShardedWorker): follow rank 0's numbers, join the process group, take
    the driver's critic, run an update on the groups it is sent, and leave."""

    def __init__(self, cfg: Any, threads: int, numerics: dict[str, Any]) -> None:
        torch.set_num_threads(threads)
        # rank 0's measured choices ("auto"'s dtype, attention's limits): the same numbers, so the
        # same gradient, on any thread count (the warnings would say only that the threads differ)
        follow(Numerics.from_dict(numerics))
        self.cfg = cfg
        self.device = resolve_device(cfg.train.device)  # with a GPU: the one Ray gave this actor (gpus_per_learner)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.fields: dict[Any, dict[str, Any]] = {}
        """The fields of this update's examples, by id (refilled by each update): what a function PRM reads."""
        self.learner: Any = None
        self.extras = Extras()

    def _rank_info(self) -> Any:
        """What this rank's parts are built from (rlvr.train.parts.learner_rank)."""
        tr = self.cfg.train
        return RankInfo(tr.steps * tr.epochs * tr.mini_batches, load_tokenizer(self.cfg.model),
                        example_fields(self.fields))

    def join(self, address: str, port: int, rank: int, world: int, timeout_s: float) -> int:
        dist.init_process_group(backend(self.cfg), init_method=f"tcp://{address}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return rank

    def load_credit(self, state: dict[str, Any]) -> None:
        assert self.extras.credit is not None
        self.extras.credit.load_state_dict(state)

    def _update(self, groups: list[Any], settings: Any, generator_state: torch.Tensor, loss_state: dict[str, float],
                pad_token_id: int, fields: dict[Any, dict[str, Any]]) -> tuple[UpdateResult, torch.Generator]:
        """The update, with the driver's random state and this update's example fields; returns
        its result and the random stream after it."""
        self.fields.clear()
        self.fields.update(fields)
        generator = torch.Generator()
        generator.set_state(generator_state)
        # the methods' parts built on this rank; the loss terms (CHORD, DPH-RL) run on the driver only
        extras = dataclasses.replace(self.extras, loss_state=loss_state)
        result = update_policy(self.learner, groups, settings, pad_token_id=pad_token_id, generator=generator,
                               **extras.keywords())
        return result, generator

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class LearnerWorker(RankActor):
    """A Ray actor: one replicated learner rank, built as the local run builds its learner
    (rlvr.train.parts.learner_rank), with whatever the config's methods need on every rank."""

    def __init__(self, cfg: Any, threads: int, numerics: dict[str, Any]) -> None:
        super().__init__(cfg, threads, numerics)
        self.learner, self.extras = learner_rank(cfg, self._rank_info(), self.device,
                                                 resolve_dtype(cfg.train.precision, self.device))

    def ready(self) -> bool:
        """Built; and whether its credit reads the examples' fields (a function PRM), sent with each update then."""
        return bool(getattr(self.extras.credit, "reads_fields", False))

    def load(self, model_state: dict[str, torch.Tensor], learner_state: dict[str, Any]) -> None:
        self.learner.model.load_state_dict(model_state)
        self.learner.load_state_dict(learner_state)

    def update(self, groups: list[Any], settings: Any, generator_state: torch.Tensor, loss_state: dict[str, float],
               pad_token_id: int, fields: dict[Any, dict[str, Any]]) -> None:
        self._update(groups, settings, generator_state, loss_state, pad_token_id, fields)


class ActorLearners(Updater):
    """What the driver's side of replicated and sharded learners (rlvr.scaleout.sharded) shares:
    the local updater's learner and random stream, bounded waits on the actors, the critic's first
    copy to them, and closing."""

    def __init__(self, local: Updater, timeout_s: float) -> None:
        super().__init__(local.learner, pad_token_id=local.pad_token_id, seed=0, shared_weights=local.shared_weights,
                         probe_ids=local.probe_ids)
        self.generator = local.generator  # the same stream of mini-batch orders, so the run is the local one
        self.ray = require_ray()
        self.timeout_s = timeout_s
        self._broken = False
        """The ranks are out of step (an update failed or timed out): closing waits for none of them."""
        self._credit_loaded = False
        self.actors: list[Any] = []

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        try:
            return list(self.ray.get(refs, timeout=self.timeout_s))
        except self.ray.exceptions.GetTimeoutError as err:
            raise TimeoutError(f"waited {self.timeout_s:.0f} s for {what} (dist.ray.timeout_s)") from err

    def _send_credit(self, extras: Extras) -> None:
        """Before the first update, the ranks' credit (PPO's critic) becomes the driver's."""
        if extras.credit is not None and not self._credit_loaded:
            state = self.ray.put(_on_cpu(extras.credit.state_dict()))
            self._wait([a.load_credit.remote(state) for a in self.actors], "the learners to load the critic")
            self._credit_loaded = True

    def close(self) -> None:
        if not self._broken:  # a rank that hung would answer `leave` only after its update: not waited for
            try:
                self.ray.get([a.leave.remote() for a in self.actors], timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 - closing: a dead actor has left already
                pass
        if dist.is_initialized():
            dist.destroy_process_group()
        for a in self.actors:
            self.ray.kill(a)
        self.actors = []


class DataParallel(ActorLearners):
    """The driver's side: starts ``learners - 1`` learner actors, forms the process group with
    them (the driver is rank 0), copies the driver's policy and optimizer state to them, and
    runs each update on every rank (an `Updater`: the loop calls it as the local one)."""

    def __init__(self, cfg: Any, local: Updater, learners: int, *, timeout_s: float,
                 fields_of: Callable[[Group], dict[str, Any]] | None = None) -> None:
        super().__init__(local, timeout_s)
        r = cfg.dist.ray_options()
        address = "127.0.0.1" if r.address is None else self.ray.util.get_node_ip_address()
        port = _free_port()
        if backend(cfg) == "nccl":  # rank 0's GPU: the one the driver's learner is on
            torch.cuda.set_device(next(local.learner.model.parameters()).device)
        actor, reserves = self.ray.remote(LearnerWorker), {"CPU": r.cpus_per_worker, "GPU": r.gpus_per_learner}
        # rank r's actor (this process is rank 0), on node r with dist.ray.spread
        self.actors = [actor.options(num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_learner,
                                     **placement(self.ray, r.spread, rank, reserves))
                       .remote(cfg, r.threads_per_worker, current().as_dict()) for rank in range(1, learners)]
        # built before the process group forms: an actor that fails to start says why, at once
        wants = self._wait([a.ready.remote() for a in self.actors], "the learner actors to load the model")
        self.fields_of = fields_of if any(wants) else None
        joined = [a.join.remote(address, port, rank, learners, timeout_s) for rank, a in enumerate(self.actors, 1)]
        dist.init_process_group(backend(cfg), init_method=f"tcp://{address}:{port}", rank=0, world_size=learners,
                                timeout=datetime.timedelta(seconds=timeout_s))
        self._wait(joined, "the learner actors to join the process group")
        model_state = self.ray.put({k: v.detach().cpu() for k, v in local.learner.model.state_dict().items()})
        learner_state = self.ray.put(local.learner.state_dict())
        self._wait([a.load.remote(model_state, learner_state) for a in self.actors], "the learners to load the policy")

    def update(self, groups: list[Group], settings: UpdateSettings, extras: Extras) -> UpdateResult:
        self._send_credit(extras)
        state = self.generator.get_state()
        # the loss terms (CHORD, DPH-RL) run on rank 0 only: the workers need none of them
        fields = {g.metadata.get("id"): self.fields_of(g) for g in groups} if self.fields_of else {}
        remote = [a.update.remote(groups, settings, state, dict(extras.loss_state or {}), self.pad_token_id, fields)
                  for a in self.actors]
        try:
            result = super().update(groups, settings, extras)
        except Exception as err:
            self._broken = True  # the ranks are out of step: closing waits for none of them
            self._raise_actor_error(remote)  # a rank that failed left rank 0 waiting in a collective: its error
            pending = [rank for rank, ref in enumerate(remote, 1) if not self.ray.wait([ref], timeout=0)[0]]
            if pending:  # alive and silent: hung, or its node gone
                raise RuntimeError(f"learner rank{'s' if len(pending) > 1 else ''} {', '.join(map(str, pending))} did "
                                   f"not answer during the update within dist.ray.timeout_s = {self.timeout_s:g} s "
                                   f"(hung, or its node gone); rank 0 gave up waiting: {err}") from err
            raise
        self._wait(remote, "the learner actors to finish the update")
        return result

    def _raise_actor_error(self, refs: list[Any]) -> None:
        """Raise the error of the first of ``refs`` that failed, if one did (after a collective timed out)."""
        done, _ = self.ray.wait(refs, num_returns=len(refs), timeout=1.0)  # a failed rank's answer is in by now
        for rank, ref in enumerate(refs, 1):
            if ref in done:
                try:
                    self.ray.get(ref)
                except Exception as err:
                    raise RuntimeError(f"learner rank {rank} failed during the update: {err}") from err
