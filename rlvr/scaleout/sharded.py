"""Sharded learners: ``dist.sharding = "fsdp"`` splits the policy's weights, gradients and optimizer
state over ``dist.learners`` Ray actors with FSDP2 (`torch.distributed.fsdp.fully_shard`), gloo
on CPUs and NCCL on GPUs.

Replicated learners (rlvr.scaleout.learners) each hold the whole model and its optimizer; here
each rank holds 1/learners of them, and a layer's weights are gathered from every rank only while
it computes. The ranks are actors alone: the driver keeps the policy of record whole, without
gradients or optimizer state (what the engine samples, evaluation scores and checkpoints hold in
Hugging Face format), and after every update rank 0 sends it the gathered weights.

Every rank runs `update_policy` on the same groups with the same random stream and takes every
world-th micro-batch (rlvr.train.parallel); backward reduces the gradients over the ranks (FSDP2
averages them: `all_reduce_grads` makes it the sum), so the step is the single learner's on the
whole batch. Ranks with fewer micro-batches run idle passes, since every forward gathers weights
from all ranks.

Precision "bf16" keeps each rank's share of the weights in fp32 and gathers them as bf16 for the
passes (FSDP2's `MixedPrecisionPolicy`), with gradients reduced in fp32: the fp32 masters of
rlvr.train.learner, sharded.

Checkpoints: every rank writes its share of the weights and the optimizer state with torch's
distributed checkpoint (`SHARDS` in the checkpoint folder, which every rank must reach: one
machine, or a filesystem shared by the nodes); a resumed run reads them onto any number of ranks.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from rlvr.lora import causal_lm
from rlvr.models import resolve_dtype
from rlvr.rollout.numerics import current
from rlvr.scaleout.cluster import placement
from rlvr.scaleout.learners import ActorLearners, RankActor, _free_port, _on_cpu
from rlvr.train.logprobs import SCORED, scored_tokens
from rlvr.train.methods.base import Extras
from rlvr.train.parts import learner_rank
from rlvr.train.update import UpdateResult, UpdateSettings
from rlvr.train.updater import Updater
from rlvr.types import Group

SHARDS = "learner_shards"
"""The folder of a checkpoint holding the sharded learners' state (torch.distributed.checkpoint)."""


def shard(model: torch.nn.Module, mixed: bool) -> torch.nn.Module:
    """``model`` sharded over the process group: each decoder layer (the model class's
    ``_no_split_modules``) a unit of its own, the rest (embeddings, head, norms) in the root's.
    ``mixed``: fp32 shares computed in bf16, gradients reduced in fp32."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from torch.distributed.fsdp import register_fsdp_forward_method

    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    lm = causal_lm(model)  # under a LoRA wrapper (which holds no weights of its own): the root of the sharding
    units: set[str] = set(getattr(lm, "_no_split_modules", None) or ())
    for module in lm.modules():
        if type(module).__name__ in units:
            fully_shard(module, mesh=mesh, mp_policy=policy)
    fully_shard(lm, mesh=mesh, mp_policy=policy)
    # the learner's passes call the inner model and read the head's weight (rlvr.train.logprobs), not
    # the model's forward: as a method FSDP2 knows, they gather the root's weights first
    setattr(lm, SCORED, types.MethodType(scored_tokens, lm))
    register_fsdp_forward_method(lm, SCORED)
    return model


def local_bytes(learner: Any) -> dict[str, int]:
    """What this rank holds of the policy: its share of the weights, gradients' room and optimizer state, in bytes."""
    def size(t: torch.Tensor) -> int:
        t = getattr(t, "_local_tensor", t)
        return t.numel() * t.element_size()

    weights = sum(size(p) for p in learner.model.parameters())
    moments = sum(size(v) for state in learner.optimizer.state.values() for v in state.values()
                  if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {"weights": weights, "optimizer": moments}


class ShardedWorker(RankActor):
    """A Ray actor: one rank of the sharded learners, built as the local run builds its learner
    (rlvr.train.parts.learner_rank) and then sharded."""

    def address(self) -> tuple[str, int]:
        """Where the process group meets: this actor's node and a free port on it (rank 0's)."""
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def build(self, model_state: dict[str, torch.Tensor]) -> dict[str, int]:
        """The rank's learner on the driver's weights, sharded; returns what it holds (`local_bytes`)."""
        dtype = resolve_dtype(self.cfg.train.precision, self.device)
        mixed = dtype != torch.float32

        def place(model: torch.nn.Module) -> torch.nn.Module:
            # bf16: the rank's share kept in fp32 and computed in bf16 (`shard`); the parts beside it stay bf16
            model = model.float() if mixed else model
            model.load_state_dict(model_state)
            return shard(model, mixed)

        self.learner, self.extras = learner_rank(self.cfg, self._rank_info(), self.device, dtype, place=place)
        return local_bytes(self.learner)

    def update(self, groups: list[Group], settings: UpdateSettings, generator_state: torch.Tensor,
               loss_state: dict[str, float], pad_token_id: int, fields: dict[Any, dict[str, Any]],
               ) -> dict[str, Any] | None:
        """One update on every rank; rank 0 returns its result, the gathered weights (every rank
        takes part in gathering them), its learning-rate schedule, and the state that moved with
        the update (the loss's, the credit's)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        result, generator = self._update(groups, settings, generator_state, loss_state, pad_token_id, fields)
        weights = get_model_state_dict(self.learner.model, options=StateDictOptions(full_state_dict=True,
                                                                                      cpu_offload=True))
        held: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(held, local_bytes(self.learner))
        if dist.get_rank() != 0:
            return None
        credit = self.extras.credit
        return {"result": result, "weights": weights, "applied_lr": self.learner.applied_lr, "held": held,
                "generator": generator.get_state(),
                "scheduler": self.learner.scheduler.state_dict(), "loss_state": loss_state,
                "credit": _on_cpu(credit.state_dict()) if credit is not None else None}

    def save(self, folder: str) -> None:
        """This rank's share of the weights and of the optimizer's state, once it has one: before the
        first step, torch's state-dict helper would make one by taking an optimizer step with zero
        gradients, which counts in Adam's bias correction (the first real step then moved 0.744 × lr)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if self.learner.optimizer.state:
            model, optimizer = get_state_dict(self.learner.model, self.learner.optimizer)
            dcp.save({"model": model, "optimizer": optimizer}, checkpoint_id=folder)
        else:
            dcp.save({"model": get_model_state_dict(self.learner.model)}, checkpoint_id=folder)

    def load(self, folder: str, scheduler: dict[str, Any]) -> None:
        """The weights and optimizer state a checkpoint's ranks saved (on as many ranks as now, or
        not: the distributed checkpoint reshards), and the driver's learning-rate schedule."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                             set_state_dict)

        saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
        if any(key.startswith("optimizer.") for key in saved):
            model, optimizer = get_state_dict(self.learner.model, self.learner.optimizer)
            dcp.load({"model": model, "optimizer": optimizer}, checkpoint_id=folder)  # in place, resharded
            set_state_dict(self.learner.model, self.learner.optimizer, model_state_dict=model,
                           optim_state_dict=optimizer)
        else:  # saved before the first step (`save`)
            model = get_model_state_dict(self.learner.model)
            dcp.load({"model": model}, checkpoint_id=folder)
            set_model_state_dict(self.learner.model, model)
        self.learner.scheduler.load_state_dict(scheduler)

class ShardedLearners(ActorLearners):
    """The driver's side: starts ``learners`` sharded learner actors (see the module docstring),
    runs each update on them, and keeps the driver's learner (its whole policy, its schedule) in
    step with them. An `Updater`: the loop calls it as the local one."""

    def __init__(self, cfg: Any, local: Updater, learners: int, *, timeout_s: float, checkpoint: Path | None,
                 fields_of: Callable[[Group], dict[str, Any]] | None = None) -> None:
        super().__init__(local, timeout_s)
        r = cfg.dist.ray_options()
        actor, reserves = self.ray.remote(ShardedWorker), {"CPU": r.cpus_per_worker, "GPU": r.gpus_per_learner}
        # rank r's actor, on node r with dist.ray.spread (rank 0 on the driver's)
        self.actors = [actor.options(num_cpus=r.cpus_per_worker, num_gpus=r.gpus_per_learner,
                                     **placement(self.ray, r.spread, rank, reserves))
                       .remote(cfg, r.threads_per_worker, current().as_dict()) for rank in range(learners)]
        address, port = self._wait([self.actors[0].address.remote()], "learner rank 0 to start")[0]
        self._wait([a.join.remote(address, port, rank, learners, timeout_s) for rank, a in enumerate(self.actors)],
                   "the learner actors to form their process group")
        weights = self.ray.put({k: v.detach().cpu() for k, v in local.learner.model.state_dict().items()})
        self.held = self._wait([a.build.remote(weights) for a in self.actors], "the learner actors to load the policy")
        """What each rank holds of the policy, in bytes (`local_bytes`)."""
        if checkpoint is not None:
            if not (checkpoint / SHARDS).is_dir():
                raise FileNotFoundError(f"{checkpoint} has no {SHARDS} folder: it was not saved by sharded learners "
                                        "(resume it without dist.sharding = \"fsdp\")")
            scheduler = self.learner.scheduler.state_dict()
            self._wait([a.load.remote(str(checkpoint / SHARDS), scheduler) for a in self.actors],
                       f"the learner actors to load {checkpoint / SHARDS}")
        self.fields_of = fields_of

    def update(self, groups: list[Group], settings: UpdateSettings, extras: Extras) -> UpdateResult:
        if extras.terms:
            raise ValueError("a loss term beside the policy loss (CHORD's SFT, DPH-RL's divergence) needs the policy "
                             "on the driver, which sharded learners do not train there: unset dist.sharding")
        self._send_credit(extras)
        fields = {g.metadata.get("id"): self.fields_of(g) for g in groups} if self.fields_of else {}
        state = self.generator.get_state()
        refs = [a.update.remote(groups, settings, state, dict(extras.loss_state or {}), self.pad_token_id, fields)
                for a in self.actors]
        try:
            answer = self._wait(refs, "the sharded learners' update")[0]
        except Exception:
            self._broken = True
            raise
        self.generator.set_state(answer["generator"])  # the mini-batch orders go on as the ranks' did
        self.held = answer["held"]
        result: UpdateResult = answer["result"]
        result.metrics["dist/learner_bytes_per_rank"] = float(max(h["weights"] + h["optimizer"] for h in self.held))
        weights = answer["weights"]
        with torch.no_grad():  # the policy of record: what the engine samples and checkpoints hold
            self.learner.model.load_state_dict(weights)
            if self.learner.mixed:  # bf16: the driver's masters are the ranks' fp32 weights (its checkpoints hold them)
                trained = [name for name, p in self.learner.model.named_parameters() if p.requires_grad]
                for name, master in zip(trained, self.learner.masters):
                    master.copy_(weights[name])
        self.learner.applied_lr = answer["applied_lr"]
        self.learner.scheduler.load_state_dict(answer["scheduler"])
        for group in self.learner.optimizer.param_groups:
            group["lr"] = answer["applied_lr"]
        if extras.loss_state is not None:
            extras.loss_state.update(answer["loss_state"])
        if extras.credit is not None and answer["credit"] is not None:
            extras.credit.load_state_dict(answer["credit"])
        return result

    def checkpoint(self, folder: Path) -> dict[str, Any]:
        """Every rank writes its share into ``folder``/`SHARDS`; the training state records how many."""
        self._wait([a.save.remote(str(folder / SHARDS)) for a in self.actors], f"the learner actors to save {folder}")
        return {"learner_shards": {"ranks": len(self.actors), "folder": SHARDS}}
