"""Off-policy corrections between the engine that sampled and the learner that trains.

The engine's log-probabilities μ (returned with every sampled token) and the learner's π_old for
the same tokens differ even with identical weights: different kernels, batch shapes and
precision (or on purpose: top-k/top-p sampling, a quantised or stale engine). The token-level
policy-gradient surrogate assumes they are equal (Qwen team, "Stabilizing Reinforcement
Learning with LLMs: Formulation and Practices", arXiv:2512.01374). A correction reweights each
token's loss by a detached importance weight built from ρ = π_old / μ.

Every function takes ``(old_logprobs_BT, sampler_logprobs_BT, mask_BT, **kwargs)`` and returns
``(weights_BT, metrics)``; weights are 0 at masked positions and carry no gradient.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlvr.algos.masked import log_ratio, masked_mean


def no_correction(old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Weight 1 on every trained token (the on-policy assumption)."""
    return mask_BT.to(old_logprobs_BT.dtype), {}


def truncated_is(
    old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, mask_BT: Tensor, *, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: w = min(ρ, cap).

    Ionides, "Truncated Importance Sampling", J. Comp. Graph. Stat. 17 (2008); applied to the
    engine/learner mismatch by Yao et al., "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (2025). level "sequence" uses the row's product of token ratios.
    Metric ``is_truncated_fraction``: tokens whose weight hit the cap.
    """
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    mask_BT = mask_BT.bool()
    ratio_BT = torch.exp(log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT, level))
    weights_BT = torch.where(mask_BT, ratio_BT.clamp(max=cap), torch.zeros_like(ratio_BT))
    return weights_BT, {"is_truncated_fraction": masked_mean(ratio_BT > cap, mask_BT),
                        "is_weight_mean": masked_mean(weights_BT, mask_BT)}


def masked_is(
    old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, mask_BT: Tensor, *,
    low: float = 0.5, high: float = 2.0, level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling: w = ρ inside [low, high], 0 outside (the token, or with level
    "sequence" the whole row, is dropped from the update).

    The masked counterpart of truncation (MIS, a baseline in the ALP work on off-policy
    corrections). Metric ``is_masked_fraction``: tokens given weight 0.
    """
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"need 0 <= low <= 1 <= high, got {low}, {high}")
    mask_BT = mask_BT.bool()
    ratio_BT = torch.exp(log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT, level))
    inside_BT = (ratio_BT >= low) & (ratio_BT <= high)
    weights_BT = torch.where(mask_BT & inside_BT, ratio_BT, torch.zeros_like(ratio_BT))
    return weights_BT, {"is_masked_fraction": masked_mean(~inside_BT, mask_BT),
                        "is_weight_mean": masked_mean(weights_BT, mask_BT)}


def mismatch_metrics(old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """How far the learner's log-probs are from the engine's: logged every step, corrected or not."""
    mask_BT = mask_BT.bool()
    log_ratio_BT = log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT)
    return {"mismatch_logratio_abs": masked_mean(log_ratio_BT.abs(), mask_BT),
            "mismatch_ratio_max": torch.where(mask_BT, log_ratio_BT.exp(), 0.0).max()}


CORRECTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "none": no_correction,
    "tis": truncated_is,
    "mis": masked_is,
}
