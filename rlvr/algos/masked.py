"""Helpers shared by the losses and the off-policy corrections: masked inputs, means and log-ratios."""

from __future__ import annotations

import torch
from torch import Tensor


def masked_mean(x_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Detached mean of x over the positions where mask_BT is set (0 when none is); bool x counts."""
    with torch.no_grad():
        return torch.where(mask_BT, x_BT.detach(), 0.0).sum() / mask_BT.sum().clamp(min=1)


def log_ratio(logprobs_BT: Tensor, base_logprobs_BT: Tensor, mask_BT: Tensor, level: str = "token") -> Tensor:
    """Detached log(p / p_base) per token (level "token"), or each row's sum over its masked
    tokens, i.e. the log of the sequence's ratio, on every token of the row (level "sequence").
    0 at masked positions."""
    if level not in ("token", "sequence"):
        raise ValueError(f"level must be 'token' or 'sequence', got {level!r}")
    log_ratio_BT = torch.where(mask_BT, logprobs_BT.detach() - base_logprobs_BT, 0.0)
    if level == "sequence":
        log_ratio_BT = torch.where(mask_BT, log_ratio_BT.sum(-1, keepdim=True).expand_as(log_ratio_BT), 0.0)
    return log_ratio_BT


def masked_inputs(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(bool mask, logprobs, advantages, log π_θ - log π_old), each 0 at masked positions.

    `torch.where`, not multiplication, so a NaN or inf at a masked position reaches neither the
    loss nor the gradient (0 · NaN = NaN). The log-ratio keeps its gradient; detach it for
    weights that must not carry one.
    """
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logprobs_BT)
    logprobs_BT = torch.where(mask_BT, logprobs_BT, zeros_BT)
    advantages_BT = torch.where(mask_BT, advantages_BT, torch.zeros_like(advantages_BT))
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT, zeros_BT)
    return mask_BT, logprobs_BT, advantages_BT, log_ratio_BT
