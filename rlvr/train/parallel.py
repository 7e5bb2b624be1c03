"""Data parallelism for the learner, over torch.distributed (gloo on CPU, NCCL on GPU).

Every rank holds the whole model and runs the same `update_policy` on the same step's groups:
advantages, mini-batch shuffles and loss totals come out identical everywhere. Only the
forward/backward work is split: each rank takes every world-th micro-batch (`share`). Before
each optimizer step the gradients are summed over ranks (`all_reduce_grads`); since the loss
totals (token and sequence counts) are those of the whole mini-batch, the sum is exactly the
gradient one learner would compute on the whole batch, and identical optimizer steps keep the
replicas identical. Metric sums are reduced the same way (`all_reduce_sums`).

Sharded learners (rlvr.scaleout.sharded: FSDP2's `fully_shard`) hold each weight's 1/world
share; every forward gathers a layer's weights from all ranks, so every rank must run as many
forward and backward passes as the others: a rank with fewer micro-batches runs idle passes
(`idle_passes`) that add a zero gradient. Their gradients come out of backward already reduced
(`sharded`): not reduced again.

Outside a process group (the local loop) every function here is a no-op.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.distributed as dist

from rlvr.train.logprobs import token_logprobs

T = TypeVar("T")


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def share(items: list[T]) -> list[T]:
    """This rank's part: every world-th item, starting at its rank."""
    rank, size = world()
    return items[rank::size] if size > 1 else items


def _is_shard(t: torch.Tensor | None) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s weights are sharded over the ranks (DTensors: FSDP2's `fully_shard`)."""
    return _is_shard(next(model.parameters(), None))


def idle_passes(model: torch.nn.Module, passes: int, pad_token_id: int) -> None:
    """On sharded learners, the forward and backward passes this rank lacks so that every rank
    has run its share of ``passes`` (every world-th, as `share` gives): each is a one-token
    forward whose loss is multiplied by zero, a zero gradient that takes part in the collectives."""
    rank, size = world()
    if size == 1 or not sharded(model):
        return

    ids_BT = torch.tensor([[pad_token_id, pad_token_id]], device=next(model.parameters()).device)
    for _ in range(-(-passes // size) - len(range(rank, passes, size))):
        logprobs_BT, _ = token_logprobs(model, ids_BT, torch.ones_like(ids_BT), torch.tensor([[0, 1]], device=ids_BT.device))  # type: ignore[arg-type]
        (logprobs_BT.sum() * 0.0).backward()


def all_reduce_grads(params: list[torch.Tensor]) -> None:
    """Sum every parameter's gradient over the ranks (a missing gradient counts as zeros).
    Sharded parameters' gradients were reduced by backward (FSDP2 averages them over the ranks):
    they are multiplied by the world size, the sum."""
    if world()[1] == 1:
        return
    if params and _is_shard(params[0]):
        for p in params:
            if p.grad is not None:  # averaged in fp32 or the grads' dtype, times a power of two or a small int
                p.grad.mul_(world()[1])
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])  # type: ignore[union-attr]
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
        offset += n


def _reduce_device() -> torch.device:
    """Where collective tensors must live: NCCL reduces GPU tensors only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sums(sums: dict[str, float]) -> dict[str, float]:
    """Metric sums over the ranks: keys starting with "_max/" take the maximum, the rest the sum.
    Ranks may hold different keys (a rank without a micro-batch holds none)."""
    if world()[1] == 1:
        return sums
    keys: list[list[str]] = [[] for _ in range(world()[1])]
    dist.all_gather_object(keys, sorted(sums))
    names = sorted({k for ks in keys for k in ks})
    maxed = [k for k in names if k.startswith("_max/")]
    summed = [k for k in names if not k.startswith("_max/")]
    out: dict[str, float] = {}
    if summed:
        t = torch.tensor([sums.get(k, 0.0) for k in summed], dtype=torch.float64, device=_reduce_device())
        dist.all_reduce(t)
        out |= dict(zip(summed, t.tolist()))
    if maxed:
        t = torch.tensor([sums.get(k, float("-inf")) for k in maxed], dtype=torch.float64, device=_reduce_device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out |= dict(zip(maxed, t.tolist()))
    return out
