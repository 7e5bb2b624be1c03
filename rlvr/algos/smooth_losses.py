"""Policy losses whose trust region is not PPO's hard token clip: SAPO's soft gate and GMPO's
geometric mean. Each returns ``(loss_BT, metrics)`` like rlvr.algos.losses; aggregation is separate.

Shapes: ``_B`` sequences, ``_T`` tokens; ``mask_BT`` is 1/True on trained tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlvr.algos.inputs import LossInputs
from rlvr.algos.masked import masked_inputs, masked_mean


def sapo_loss(
    x: LossInputs,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> tuple[Tensor, dict[str, Tensor]]:
    """SAPO: a smooth, temperature-controlled gate on each token's ratio instead of a hard clip.

    r    = exp(log π_θ − log π_old)                         (log-ratio clamped to ±20 for exp)
    f(r) = σ(τ (r − 1)) · 4/τ,    τ = tau_pos where A > 0, else tau_neg
    loss = −f(r) · A, per token

    Gao et al., "Soft Adaptive Policy Optimization", arXiv:2511.20347 (Qwen team). df/dr =
    4σ(1 − σ) is 1 at r = 1, so on-policy the gradient is plain policy gradient. It decays
    smoothly as r leaves 1, faster for a larger τ; the paper uses τ_neg > τ_pos, to damp
    negative updates more. The defaults 1.0 / 1.05 are verl's (its ActorConfig). The paper
    averages per sequence: aggregate with ``"seq-mean-token-mean"``. Checked against the paper's
    formula and verl 0.9.1's ``compute_policy_loss_sapo`` (docs/algorithms.md).

    Metrics: ``gate_mean`` (mean f'(r) = 4σ(1 − σ) over trained tokens: 1 on-policy, smaller as
    the gate damps), ``ratio_mean``.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if tau_pos <= 0 or tau_neg <= 0:
        raise ValueError(f"tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    mask_BT, _, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT.clamp(-20.0, 20.0))
    tau_BT = torch.where(advantages_BT > 0, torch.tensor(tau_pos, dtype=ratio_BT.dtype, device=ratio_BT.device),
                         torch.tensor(tau_neg, dtype=ratio_BT.dtype, device=ratio_BT.device))
    sigma_BT = torch.sigmoid(tau_BT * (ratio_BT - 1.0))
    loss_BT = torch.where(mask_BT, -sigma_BT * (4.0 / tau_BT) * advantages_BT, 0.0)
    with torch.no_grad():
        metrics = {"gate_mean": masked_mean((4 * sigma_BT * (1 - sigma_BT)).detach(), mask_BT),
                   "ratio_mean": masked_mean(ratio_BT.detach(), mask_BT)}
    return loss_BT, metrics


def gmpo_loss(
    x: LossInputs,
    *,
    clip_low: float = 0.4,
    clip_high: float = 0.4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GMPO: the geometric mean of the token ratios, each clipped in log space, times A.

    ℓ_t  = log π_θ − log π_old, clipped pessimistically: for A > 0, min(ℓ_t, clip_high);
           for A < 0, max(ℓ_t, −clip_low) (PPO's rule, in log space)
    s_b  = exp(1/|y_b| Σ_t ℓ_t)                        (the geometric mean of the clipped ratios)
    loss = −A_b · s_b, on every token of row b

    Zhao et al., "Geometric-Mean Policy Optimization", arXiv:2507.20673. The geometric mean is
    less sensitive than GRPO's arithmetic mean to a few tokens with extreme ratios, which is
    what allows the wider range: the paper clips at (e^−0.4, e^0.4), the defaults here. The
    advantage is the row's (outcome advantages are constant along a row; the row mean is used,
    as verl does). The per-token loss repeats the row's value, so aggregate with
    ``"seq-mean-token-mean"`` for the paper's mean over sequences. Checked against the paper's
    objective and verl 0.9.1's ``compute_policy_loss_geo_mean`` (docs/algorithms.md).

    Metrics: ``clip_fraction`` (trained tokens whose log-ratio was clipped on the side that
    matters), ``ratio_mean`` (mean s_b over rows with tokens).
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if clip_low < 0 or clip_high < 0:
        raise ValueError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    mask_BT, _, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    zeros_BT = torch.zeros_like(log_ratio_BT)
    lengths_B = mask_BT.sum(-1)
    has_tokens_B = lengths_B > 0
    advantages_B = advantages_BT.sum(-1) / lengths_B.clamp(min=1)
    positive_B1 = (advantages_B > 0)[:, None]
    clipped_BT = torch.where(positive_B1, torch.minimum(log_ratio_BT, torch.full_like(log_ratio_BT, clip_high)),
                             torch.maximum(log_ratio_BT, torch.full_like(log_ratio_BT, -clip_low)))
    seq_ratio_B = torch.exp(torch.where(mask_BT, clipped_BT, zeros_BT).sum(-1) / lengths_B.clamp(min=1))
    loss_B = torch.where(has_tokens_B, -advantages_B * seq_ratio_B, torch.zeros_like(seq_ratio_B))
    loss_BT = torch.where(mask_BT, loss_B[:, None].expand_as(logprobs_BT), zeros_BT)
    with torch.no_grad():
        active_BT = (clipped_BT != log_ratio_BT) & mask_BT & (advantages_B != 0)[:, None]
        rows = has_tokens_B.sum().clamp(min=1).to(seq_ratio_B.dtype)
        metrics = {"clip_fraction": masked_mean(active_BT.to(seq_ratio_B.dtype), mask_BT),
                   "ratio_mean": torch.where(has_tokens_B, seq_ratio_B.detach(), 0.0).sum() / rows}
    return loss_BT, metrics
