"""Per-token policy losses. Each returns ``(loss_BT, metrics)``; aggregation is separate.

Shapes: ``_B`` sequences, ``_T`` tokens. ``mask_BT`` is 1/True on tokens that are trained on.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from rlvr.algos.masked import log_ratio, masked_mean


def ppo_clip_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token, as a loss to minimise (default range [0.8, 1.28]).

    ratio = exp(logprobs - old_logprobs)
    loss  = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    loss  = min(loss, -dual_clip * A)   for A < 0, if dual_clip is set

    PPO: Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347.
    Separate ``clip_low``/``clip_high`` is DAPO's clip-higher (Yu et al., "DAPO: An Open-Source
    LLM Reinforcement Learning System at Scale", arXiv:2503.14476; they use 0.2/0.28, rlvr's
    default; 0.2/0.2 is the original PPO).
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

        def token_mean(x_BT: Tensor) -> Tensor:
            return torch.where(mask_BT, x_BT.to(ratio.dtype), 0.0).sum() / num_tokens

        metrics = {
            "clip_fraction": token_mean(clipped_high_BT | clipped_low_BT),
            "clip_fraction_low": token_mean(clipped_low_BT),
            "clip_fraction_high": token_mean(clipped_high_BT),
            "dual_clip_fraction": token_mean(dual_clipped_BT),
            "ratio_mean": token_mean(ratio),
            # ratio > 0, so 0 at masked positions never wins unless every token is masked.
            "ratio_max": torch.where(mask_BT, ratio, 0.0).max(),
        }
    return loss_BT, metrics


def pg_loss(
    logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient (REINFORCE with the given advantages): loss = -A · log π_θ.

    Williams, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
    Learning", Machine Learning 8 (1992). No ratio and no clipping: the gradient is -A ∇log π_θ,
    which equals PPO's at ratio 1, i.e. on-policy. ``old_logprobs_BT`` only feeds the
    ``ratio_mean`` metric (how far off-policy the data is).
    """
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = _masked(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    loss_BT = -advantages_BT * logprobs_BT
    return loss_BT, {"ratio_mean": masked_mean(torch.exp(log_ratio_BT), mask_BT)}


def cispo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    min_weight: float = 0.0,
    max_weight: float = 2.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO: REINFORCE weighted by the clipped, detached importance ratio.

    w = sg(clip(π_θ / π_old, min_weight, max_weight));   loss = -w · A · log π_θ

    MiniMax, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention",
    arXiv:2506.13585, eq. 4-5 (there written with 1 - ε_low and 1 + ε_high). Unlike PPO, a token
    whose ratio leaves the range keeps its gradient (only its weight is capped), so rare
    "fork" tokens are never dropped from the update. MiniMax-M1 sets no lower bound
    (``min_weight = 0``) and tunes only the upper one; ``max_weight = 2`` here is rlvr's default
    choice, not a value from the paper. On-policy (ratio 1) this is ``pg``.

    Metrics: ``weight_clip_fraction`` (tokens whose weight was capped), ``ratio_mean``.
    """
    if not 0.0 <= min_weight <= 1.0 <= max_weight:
        raise ValueError(f"need 0 <= min_weight <= 1 <= max_weight, got {min_weight}, {max_weight}")
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = _masked(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT.detach())
    weight_BT = ratio_BT.clamp(min_weight, max_weight)
    loss_BT = -weight_BT * advantages_BT * logprobs_BT
    metrics = {
        "weight_clip_fraction": masked_mean(((ratio_BT < min_weight) | (ratio_BT > max_weight)).to(ratio_BT.dtype), mask_BT),
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
    }
    return loss_BT, metrics


def gspo_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: PPO's clipped surrogate on a length-normalised sequence-level ratio.

    s_b  = exp(1/|y_b| Σ_t (log π_θ - log π_old))        (the geometric mean of token ratios)
    loss = -min(s_b A_b, clip(s_b, 1 - clip_low, 1 + clip_high) A_b), on every token of row b

    Zheng et al., "Group Sequence Policy Optimization", arXiv:2507.18071 (their clip range is
    3e-4 / 4e-4, much narrower than PPO's, because s is a per-token average). The advantage is
    read from the first trained token of each row (outcome advantages are constant along a row).
    The per-token loss repeats the row's value, so aggregate with "seq-mean-token-mean" to get
    the paper's sequence mean; the gradient of s_b spreads over the row's tokens as
    s_b/|y_b| ∇log π_θ(y_t). Rows with no trained token get 0.

    Metrics: ``clip_fraction`` (share of sequences clipped), ``ratio_mean`` (mean s_b).
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(logprobs_BT)
    log_ratio_BT = torch.where(mask_BT, logprobs_BT - old_logprobs_BT, zeros_BT)
    lengths_B = mask_BT.sum(-1)
    has_tokens_B = lengths_B > 0
    seq_ratio_B = torch.exp(log_ratio_BT.sum(-1) / lengths_B.clamp(min=1))
    first_B = mask_BT.float().argmax(-1)
    advantages_B = torch.where(has_tokens_B, advantages_BT.gather(-1, first_B[:, None]).squeeze(-1),
                               torch.zeros_like(seq_ratio_B))
    surrogate_B = seq_ratio_B * advantages_B
    clipped_B = seq_ratio_B.clamp(1.0 - clip_low, 1.0 + clip_high) * advantages_B
    loss_B = torch.where(has_tokens_B, -torch.minimum(surrogate_B, clipped_B), torch.zeros_like(surrogate_B))
    loss_BT = torch.where(mask_BT, loss_B[:, None].expand_as(logprobs_BT), zeros_BT)
    with torch.no_grad():
        ratio_B = seq_ratio_B.detach()
        clipped = ((advantages_B > 0) & (ratio_B > 1 + clip_high)) | ((advantages_B < 0) & (ratio_B < 1 - clip_low))
        rows = has_tokens_B.sum().clamp(min=1).to(ratio_B.dtype)
        metrics = {"clip_fraction": (clipped & has_tokens_B).sum() / rows,
                   "ratio_mean": torch.where(has_tokens_B, ratio_B, 0.0).sum() / rows}
    return loss_BT, metrics


def topr_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """TOPR, tapered off-policy REINFORCE: positives like SFT, negatives with a ratio capped at 1.

    loss = -sg(α) · A · log π_θ,   α = 1 if A >= 0,   α = clamp(ρ, 0, 1) if A < 0

    Le Roux et al., "Tapered Off-Policy REINFORCE: Stable and efficient reinforcement learning for
    LLMs", arXiv:2503.14286 (written there with the reward R; rlvr passes the advantage, i.e. the
    reward minus a baseline, which the paper's baseline discussion covers). The paper's ratio is
    per sequence, π_θ(y)/π_old(y) (``level = "sequence"``: the product of the row's token
    ratios); ``level = "token"`` uses each token's own ratio, as some implementations do.
    Metric ``topr_clamped_fraction``: negative-advantage tokens whose ratio exceeded 1.
    """
    mask_BT, logprobs_BT, advantages_BT, _ = _masked(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio(logprobs_BT, old_logprobs_BT, mask_BT, level))
    negative_BT = advantages_BT < 0
    alpha_BT = torch.where(negative_BT, ratio_BT.clamp(0.0, 1.0), torch.ones_like(ratio_BT))
    loss_BT = -alpha_BT * advantages_BT * logprobs_BT
    clamped = mask_BT & negative_BT & (ratio_BT > 1.0)
    negatives = (mask_BT & negative_BT).sum().clamp(min=1).to(ratio_BT.dtype)
    return loss_BT, {"topr_clamped_fraction": clamped.sum().to(ratio_BT.dtype) / negatives,
                     "ratio_mean": masked_mean(ratio_BT, mask_BT)}


def opmd_loss(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_BT: Tensor,
    mask_BT: Tensor,
    *,
    tau: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Online policy mirror descent (Kimi k1.5): REINFORCE plus a squared log-ratio penalty.

    loss = -A · log π_θ + τ/2 · (log π_θ - log π_old)²

    Kimi Team, "Kimi k1.5: Scaling Reinforcement Learning with LLMs", arXiv:2501.12599, §2.3.2:
    the gradient of their surrogate is Σ_j [∇log π(y_j)(r_j - r̄) - τ/2 ∇(log π(y_j)/π_old(y_j))²]
    over whole responses. This is the per-token form of that penalty (the REP/OPMD regulariser of
    "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm", arXiv:2509.24203): at π_θ =
    π_old it adds nothing, and it pulls tokens that moved back toward the sampling policy.
    Pair it with ``dr_grpo`` (the paper's baseline is the mean reward, without std division).
    Metric ``opmd_penalty``: mean of (log π_θ - log π_old)² / 2.
    """
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = _masked(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    penalty_BT = 0.5 * log_ratio_BT**2
    loss_BT = -advantages_BT * logprobs_BT + tau * penalty_BT
    return loss_BT, {"opmd_penalty": masked_mean(penalty_BT, mask_BT),
                     "ratio_mean": masked_mean(torch.exp(log_ratio_BT), mask_BT)}


def _masked(
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


LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip_loss,
    "pg": pg_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "topr": topr_loss,
    "opmd": opmd_loss,
}
