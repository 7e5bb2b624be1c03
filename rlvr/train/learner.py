"""The learner: owns the policy's weights, the optimizer and the learning-rate schedule.

Precision "bf16" keeps the model's weights in bfloat16 (faster matrix products on GPUs and on
CPUs where bf16 is measured faster, see rlvr.models.fast_bf16) and an fp32 master copy inside AdamW: after backward, bf16 gradients are
copied to the fp32 masters, clipped and stepped there, and the masters are rounded back into the
model. Updates smaller than bf16's resolution therefore accumulate instead of vanishing, which is
the instability of plain bf16 training. Precision "fp32" trains the model's own fp32 weights.

The optimizer is AdamW ("adamw", torch's fused kernel where it runs) or AdamW with compact moments
("adamw_compact", rlvr.train.compact_adamw: 3 bytes a weight of optimizer state instead of 8, for
more time per step than the fused kernel).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from rlvr.train.compact_adamw import CompactAdamW
from rlvr.train.parallel import all_reduce_grads

log = logging.getLogger(__name__)



def _adamw(params: list[torch.Tensor], **hyper: Any) -> torch.optim.Optimizer:
    # the fused kernel: one pass per tensor instead of a dozen elementwise ops (the default on a
    # CPU); on SmolLM2-135M in fp32, 0.09 s a step against 0.4-1.5 s (docs/LOG.md)
    fused = all(p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **hyper)


if TYPE_CHECKING:
    from rlvr.config.sections import TrainConfig

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {"adamw": _adamw, "adamw_compact": CompactAdamW}
"""train.optimizer -> a constructor taking the fp32 weights, lr, betas and weight_decay."""


def lr_lambda(step: int, *, warmup_steps: int, total_steps: int, schedule: str) -> float:
    """Multiplier of the peak learning rate at optimizer step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown schedule {schedule!r}; use constant, linear or cosine")


class Learner:
    """Gradient steps on a causal LM, or on the critic (any torch module); see the module docstring
    for the precision scheme."""

    def __init__(
        self,
        model: Any,
        *,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        grad_clip: float = 1.0,
        warmup_steps: int = 0,
        total_steps: int = 1,
        schedule: str = "constant",
        optimizer: str = "adamw",
    ) -> None:
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; use one of {', '.join(OPTIMIZERS)}")
        self.model = model
        self.optimizer_name = optimizer
        self.grad_clip = grad_clip
        self.base_lr, self.betas, self.weight_decay = lr, betas, weight_decay
        self.applied_lr = lr  # the learning rate of the last optimizer step
        self.skipped_steps = 0  # optimizer steps skipped for a gradient that was not finite (`step`)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        # fp32 masters for low-precision weights; plain fp32 weights are their own masters
        self.masters = (
            [p.detach().float().clone().requires_grad_(True) for p in self.params] if self.mixed else self.params
        )
        self.optimizer = OPTIMIZERS[optimizer](self.masters, lr=lr, betas=betas, weight_decay=weight_decay)
        self.fused = bool(self.optimizer.defaults.get("fused"))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_lambda(s, warmup_steps=warmup_steps, total_steps=total_steps, schedule=schedule),
        )

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> float:
        """Clip, apply one optimizer step and advance the schedule; returns the pre-clip grad norm.
        A gradient that is not finite is not applied (the step is skipped, logged and counted in
        `skipped_steps`).

        With no gradient at all (every sample of the mini-batch was skipped for having zero
        advantage), the step uses a zero gradient, so AdamW's momentum and weight decay still
        apply exactly as if the zero gradient had been computed.
        """
        self.applied_lr = self.lr
        all_reduce_grads(self.params)  # data-parallel learners: the whole batch's gradient on every rank
        if all(p.grad is None for p in self.params):
            for p in self.params:
                p.grad = torch.zeros_like(p)
        if self.mixed:
            for p, m in zip(self.params, self.masters):
                m.grad = None if p.grad is None else p.grad.float()
                p.grad = None
        grads = [m for m in self.masters if m.grad is not None]
        # max_norm = inf measures the norm without clipping
        norm = torch.nn.utils.clip_grad_norm_(grads, self.grad_clip if self.grad_clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):  # sharded learners' gradients: the norm over every rank's share
            norm = norm.full_tensor()
        if not torch.isfinite(norm):
            # a nan or inf anywhere in the gradient (a reward or a loss that was not finite) would
            # write nan into every weight: the step is skipped and said, the weights kept
            log.warning("the gradient's norm is %s: this optimizer step is skipped, the weights are unchanged (look "
                        "for a reward or a loss that is not finite)", float(norm))
            self.skipped_steps += 1
            self.zero_grad()
            return float(norm)
        self.optimizer.step()
        if self.fused:  # the fused kernel writes the weights without bumping their version counters,
            # which is how the engine's static decoder sees that its weight copies are stale
            torch.autograd.graph.increment_version(self.masters)
        self.scheduler.step()
        if self.mixed:
            with torch.no_grad():
                for p, m in zip(self.params, self.masters):
                    p.copy_(m)
        self.zero_grad()
        return float(norm)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                                 "optimizer_name": self.optimizer_name}
        if self.mixed:
            state["masters"] = [m.detach().clone() for m in self.masters]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("optimizer_name", "adamw")  # checkpoints from before the choice were AdamW's
        if saved != self.optimizer_name:
            raise ValueError(f"the checkpoint holds the optimizer state of train.optimizer = {saved!r}, and this run "
                             f"uses {self.optimizer_name!r}: resume with train.optimizer = {saved!r}")
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        # The saved state carries the old run's hyperparameters; this learner's (e.g. a resumed run
        # given a new lr, or more steps, which stretch a linear or cosine schedule) take over.
        self.scheduler.base_lrs = [self.base_lr] * len(self.optimizer.param_groups)
        for group, factor in zip(self.optimizer.param_groups, self.scheduler.lr_lambdas):
            group.update(initial_lr=self.base_lr, betas=self.betas, weight_decay=self.weight_decay,
                         lr=self.base_lr * factor(self.scheduler.last_epoch))
            if "fused" in group:  # AdamW's: a checkpoint from before the fused kernel
                group.update(fused=self.fused or None, foreach=None)
        if self.mixed:
            with torch.no_grad():
                for p, m, saved in zip(self.params, self.masters, state["masters"]):
                    m.copy_(saved)
                    p.copy_(saved)


def learner_for(model: Any, train: TrainConfig, total_steps: int, *, lr: float | None = None) -> Learner:
    """The learner a run's `train` section describes (lr: another rate, e.g. the critic's)."""
    return Learner(model, lr=train.lr if lr is None else lr, betas=train.betas, weight_decay=train.weight_decay,
                   grad_clip=train.grad_clip, warmup_steps=train.warmup_steps, total_steps=total_steps,
                   schedule=train.schedule, optimizer=train.optimizer)
