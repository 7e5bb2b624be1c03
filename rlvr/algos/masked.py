"""Helpers shared by the losses and the off-policy corrections: masked means and log-ratios."""

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
