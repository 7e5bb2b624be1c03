"""Per-token policy losses. Each returns ``(loss_BT, metrics)``; aggregation is separate.

Shapes: ``_B`` sequences, ``_T`` tokens. ``mask_BT`` is 1/True on tokens that are trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def ppo_clip_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token, as a loss to minimise.

    ratio = exp(logprobs - old_logprobs)
    loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss  = min(loss, -dual_clip * A)   for A < 0, if dual_clip is set

    PPO: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    Separate ``clip_low``/``clip_high`` is DAPO's clip-higher (Yu et al., "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale", arXiv:2503.14476; they use 0.2/0.28).
    Dual-clip caps the loss of negative-advantage tokens whose ratio has grown past
    ``dual_clip`` (Ye et al., "Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", arXiv:1912.09729; c = 3 there).

    Masked positions of ``loss_BT`` are exactly 0, and a NaN/inf there in any input reaches
    neither the loss nor the gradient: inputs are selected with ``torch.where`` before use.

    Metrics (detached 0-dim tensors, means over unmasked tokens):
        clip_fraction_high: A > 0 and ratio > 1 + clip_high (PPO clip active, zero gradient).
        clip_fraction_low:  A < 0 and ratio < 1 - clip_low  (PPO clip active, zero gradient).
        clip_fraction:      either of the two above.
        dual_clip_fraction: A < 0 and ratio > dual_clip (dual-clip cap active, zero gradient);
                            not counted in clip_fraction.
        ratio_mean, ratio_max.

    Args:
        logprobs_BT: log pi_theta of the sampled tokens, [B, T], with gradient.
        old_logprobs_BT: log pi_old of the same tokens (the sampling policy), [B, T].
        advantages_BT: per-token advantages, [B, T].
        mask_BT: 1/True on trained tokens, [B, T].
    Returns:
        loss_BT: [B, T], not aggregated (see ``aggregate_loss``); metrics.
    """
    if not 0.0 <= clip_low < 1.0:
        raise ValueError(f"clip_low must be in [0, 1), got {clip_low}")
    if clip_high < 0.0:
        raise ValueError(f"clip_high must be >= 0, got {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be None or > 1, got {dual_clip}")

    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logprobs_BT)
    # where, not multiplication: 0 * NaN = NaN, and exp's backward would multiply by it too.
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT, zeros_BT)
    advantages_BT = torch.where(mask_BT, advantages_BT, torch.zeros_like(advantages_BT))

    ratio_BT = torch.exp(log_ratio_BT)
    surrogate_BT = ratio_BT * advantages_BT
    clipped_surrogate_BT = torch.clamp(ratio_BT, 1.0 - clip_low, 1.0 + clip_high) * advantages_BT
    loss_BT = -torch.minimum(surrogate_BT, clipped_surrogate_BT)
    if dual_clip is not None:
        dual_cap_BT = -dual_clip * advantages_BT
        loss_BT = torch.where(advantages_BT < 0, torch.minimum(loss_BT, dual_cap_BT), loss_BT)
    loss_BT = torch.where(mask_BT, loss_BT, zeros_BT)

    with torch.no_grad():
        ratio = ratio_BT.detach()
        clipped_high_BT = (advantages_BT > 0) & (ratio > 1.0 + clip_high)
        clipped_low_BT = (advantages_BT < 0) & (ratio < 1.0 - clip_low)
        dual_clipped_BT = (
            (advantages_BT < 0) & (ratio > dual_clip)
            if dual_clip is not None
            else torch.zeros_like(mask_BT)
        )
        num_tokens = mask_BT.sum().clamp(min=1).to(ratio.dtype)

        def masked_mean(x_BT: Tensor) -> Tensor:
            return torch.where(mask_BT, x_BT.to(ratio.dtype), 0.0).sum() / num_tokens

        metrics = {
            "clip_fraction": masked_mean(clipped_high_BT | clipped_low_BT),
            "clip_fraction_low": masked_mean(clipped_low_BT),
            "clip_fraction_high": masked_mean(clipped_high_BT),
            "dual_clip_fraction": masked_mean(dual_clipped_BT),
            "ratio_mean": masked_mean(ratio),
            # ratio > 0, so 0 at masked positions never wins unless every token is masked.
            "ratio_max": torch.where(mask_BT, ratio, 0.0).max(),
        }
    return loss_BT, metrics


LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip_loss,
}
