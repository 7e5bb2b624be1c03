"""Per-token policy losses. Each takes a micro-batch's `LossInputs` (rlvr.algos.inputs) and its
keyword options, and returns ``(loss_BT, metrics)``; aggregation is separate.

Shapes: ``_B`` sequences, ``_T`` tokens. ``mask_BT`` is 1/True on tokens that are trained on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from rlvr.algos.inputs import LossInputs
from rlvr.algos.masked import log_ratio, masked_inputs, masked_mean
from rlvr.algos.entropy_control import clip_cov_loss, kl_cov_loss
from rlvr.algos.smooth_losses import gmpo_loss, sapo_loss


def ppo_clip_loss(
    x: LossInputs,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip: float | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate, per token, as a loss to minimise (default range [0.8, 1.28]).
    ``clip_low = 1`` and ``clip_high = inf`` clip nothing: plain importance-weighted REINFORCE,
    loss = -ratio * A (Tinker's ``importance_sampling``).

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
        x: the micro-batch's inputs; reads ``logprobs`` (log π_θ of the sampled tokens, with
           gradient), ``old`` (log π_old of the same tokens), ``advantages`` and ``mask``.
    Returns:
        loss_BT: [B, T], not aggregated (see ``aggregate_loss``); metrics.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not 0.0 <= clip_low <= 1.0:  # 1: no lower bound (a ratio is > 0)
        raise ValueError(f"clip_low must be in [0, 1], got {clip_low}")
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


def pg_loss(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Plain policy gradient (REINFORCE with the given advantages): loss = -A · log π_θ.

    Williams, "Simple Statistical Gradient-Following Algorithms for Connectionist Reinforcement
    Learning", Machine Learning 8 (1992). No ratio and no clipping: the gradient is -A ∇log π_θ,
    which equals PPO's at ratio 1, i.e. on-policy. ``old_logprobs_BT`` only feeds the
    ``ratio_mean`` metric (how far off-policy the data is).
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    loss_BT = -advantages_BT * logprobs_BT
    return loss_BT, {"ratio_mean": masked_mean(torch.exp(log_ratio_BT), mask_BT)}


def cispo_loss(
    x: LossInputs,
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
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not 0.0 <= min_weight <= 1.0 <= max_weight:
        raise ValueError(f"need 0 <= min_weight <= 1 <= max_weight, got {min_weight}, {max_weight}")
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT.detach())
    weight_BT = ratio_BT.clamp(min_weight, max_weight)
    loss_BT = -weight_BT * advantages_BT * logprobs_BT
    metrics = {
        "weight_clip_fraction": masked_mean(((ratio_BT < min_weight) | (ratio_BT > max_weight)).to(ratio_BT.dtype), mask_BT),
        "ratio_mean": masked_mean(ratio_BT, mask_BT),
    }
    return loss_BT, metrics


def gspo_loss(
    x: LossInputs,
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
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
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
    x: LossInputs,
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
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    mask_BT, logprobs_BT, advantages_BT, _ = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio(logprobs_BT, old_logprobs_BT, mask_BT, level))
    negative_BT = advantages_BT < 0
    alpha_BT = torch.where(negative_BT, ratio_BT.clamp(0.0, 1.0), torch.ones_like(ratio_BT))
    loss_BT = -alpha_BT * advantages_BT * logprobs_BT
    clamped = mask_BT & negative_BT & (ratio_BT > 1.0)
    negatives = (mask_BT & negative_BT).sum().clamp(min=1).to(ratio_BT.dtype)
    return loss_BT, {"topr_clamped_fraction": clamped.sum().to(ratio_BT.dtype) / negatives,
                     "ratio_mean": masked_mean(ratio_BT, mask_BT)}


def opmd_loss(
    x: LossInputs,
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
    It is also DRO's objective (Richemond et al., "Offline Regularised Reinforcement Learning for
    Large Language Models Alignment", arXiv:2405.19107), Tinker's ``dro`` with β = τ.
    Metric ``opmd_penalty``: mean of (log π_θ - log π_old)² / 2.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if tau < 0:
        raise ValueError(f"tau must be >= 0, got {tau}")
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    penalty_BT = 0.5 * log_ratio_BT**2
    loss_BT = -advantages_BT * logprobs_BT + tau * penalty_BT
    return loss_BT, {"opmd_penalty": masked_mean(penalty_BT, mask_BT),
                     "ratio_mean": masked_mean(torch.exp(log_ratio_BT), mask_BT)}


def bapo_loss(
    x: LossInputs,
    *,
    target_share: float = 0.5,
    low_start: float = 0.6,
    low_max: float = 0.9,
    low_step: float = 0.05,
    high_start: float = 1.2,
    high_max: float = 3.0,
    high_step: float = 0.05,
    dual_clip: float | None = 3.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """BAPO: PPO-clip whose bounds [c_low, c_high] are searched per batch until the tokens with a
    positive advantage carry a target share of the update.

    Over the batch's tokens, with ρ the (detached) ratio, the tokens whose gradient survives PPO's
    clip under bounds (c_low, c_high) contribute
        pos = Σ_{A > 0, ρ <= c_high} A·ρ        neg = Σ_{A < 0, ρ >= c_low} |A|·ρ
    and the positive share is pos / (pos + neg). Starting from (low_start, high_start), c_low is
    raised by low_step up to low_max, then c_high by high_step up to high_max, stopping at the
    first bounds whose share reaches ``target_share`` (the last bounds if none does). The loss is
    then ``ppo_clip`` with clip_low = 1 - c_low, clip_high = c_high - 1 and ``dual_clip``.

    Xi et al., "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced Policy
    Optimization with Adaptive Clipping", arXiv:2510.18927; WooooDyy/BAPO. Conventions chosen here:
    (1) the target is a *share* (the README's ρ0 = 0.5); the released code compares the ratio
    pos/neg, for which share 0.5 is ratio 1 (its yaml default), while its example script's 0.5
    would be a share of 1/3. (2) The code sums the clipped surrogate of every token, under which
    raising c_low *adds* negative mass; here only tokens whose gradient survives the clip count,
    so raising c_low (dropping stale low-probability negatives) and raising c_high (admitting
    positives) both raise the share, the mechanism the paper describes. (3) Lower bound first,
    as in the code. Ranges and steps are the README's ([0.6, 0.9], [1.2, 3.0]); dual-clip c = 3
    as in the code. The search runs on the batch the loss is given, i.e. per micro-batch (the
    reference runs it per micro-batch too, all-reduced only across data-parallel ranks), so unlike
    the other losses the result depends on micro_batch_size once the data is off-policy.

    Metrics: ``bapo_clip_low`` / ``bapo_clip_high`` (the chosen ratio bounds), ``bapo_positive_share``
    (the share at those bounds), and ppo_clip's clip fractions.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not (0.0 < target_share <= 1.0 and 0.0 < low_start <= low_max < 1.0 and 1.0 < high_start <= high_max
            and low_step > 0 and high_step > 0):
        raise ValueError("BAPO needs 0 < target_share <= 1, 0 < low_start <= low_max < 1, "
                         "1 < high_start <= high_max and positive steps")
    mask_BT = mask_BT.bool()
    with torch.no_grad():
        ratio_N = torch.exp(torch.where(mask_BT, logprobs_BT.detach() - old_logprobs_BT, 0.0))[mask_BT]
        adv_N = advantages_BT.detach()[mask_BT]
        lows = [low_start + k * low_step for k in range(int((low_max - low_start) / low_step + 1e-9) + 1)]
        highs = [high_start + k * high_step for k in range(int((high_max - high_start) / high_step + 1e-9) + 1)]
        candidates = [(lo, high_start) for lo in lows] + [(lows[-1], hi) for hi in highs[1:]]
        lo_C = torch.tensor([c[0] for c in candidates], dtype=ratio_N.dtype, device=ratio_N.device)[:, None]
        hi_C = torch.tensor([c[1] for c in candidates], dtype=ratio_N.dtype, device=ratio_N.device)[:, None]
        pos_C = torch.where((adv_N > 0) & (ratio_N <= hi_C), adv_N * ratio_N, 0.0).sum(-1)
        neg_C = torch.where((adv_N < 0) & (ratio_N >= lo_C), -adv_N * ratio_N, 0.0).sum(-1)
        share_C = torch.where(pos_C + neg_C > 0, pos_C / (pos_C + neg_C).clamp(min=1e-30), torch.ones_like(pos_C))
        reached = (share_C >= target_share).nonzero()
        k = int(reached[0, 0]) if len(reached) else len(candidates) - 1
    c_low, c_high = candidates[k]
    loss_BT, metrics = ppo_clip_loss(x, clip_low=1.0 - c_low, clip_high=c_high - 1.0, dual_clip=dual_clip)
    metrics |= {"bapo_clip_low": torch.tensor(c_low), "bapo_clip_high": torch.tensor(c_high),
                "bapo_positive_share": share_C[k]}
    return loss_BT, metrics


_REC_CLIPS = ("none", "one-side", "two-side", "ring")
_REC_WEIGHTS = ("none", "ratio", "advantage")
_REC_REGULARIZERS = ("none", "asymre", "opmd")


def rec_loss(
    x: LossInputs,
    *,
    clip: str = "one-side",
    weight: str = "none",
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    eps_low_prime: float = 0.6,
    eps_high_prime: float = 2.0,
    temperature: float = 1.0,
    regularizer: str = "none",
    reg_coef: float = 0.1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REC: group-relative REINFORCE with clipping used as a regulariser (a token mask), not a surrogate.

    loss = -A · w · log π_θ · 1[keep]   (+ the regulariser), with ρ = π_θ/π_old detached:
      keep, clip = "none":     every token
               "two-side":     1 - eps_low <= ρ <= 1 + eps_high
               "one-side":     ρ <= 1 + eps_high if A >= 0;  ρ >= 1 - eps_low if A <= 0
               "ring":         two-side, or far outside on the side that cannot grow:
                               (A >= 0 and ρ <= 1 - eps_low_prime) or (A <= 0 and ρ >= 1 + eps_high_prime)
      w,    weight = "none": 1;   "ratio": ρ (importance sampling);   "advantage": exp(A / temperature)
      regulariser = "asymre": -reg_coef · log π_θ on every token (AsymRE: a lowered baseline,
                               forward KL to the behaviour data);
                    "opmd":   +reg_coef · (log π_θ - log π_old)² on every token (the k2 / mirror-descent
                               penalty, without a ½)

    Yao et al., "Group-Relative REINFORCE Is Secretly an Off-Policy Algorithm: Demystifying Some
    Myths About GRPO and Its Friends", arXiv:2509.24203; the options and their meaning follow the
    authors' Trinity-RFT ``rec_policy_loss`` (clip_mode, weight = importance_sampling / advantage,
    regularizer = forward-kl / k2), renamed here. Recipes: REC-OneSide-NoIS = one-side + none;
    REC-OneSide-IS = one-side + ratio (with std-normalised advantages, this is GRPO's gradient);
    REC-Ring-NoIS = ring with eps' = 0.6 / 2.0; RED-Weight = clip none + weight advantage
    (unnormalised, as in the code); AsymRE and OPMD = clip none + their regulariser at 0.1.
    The ring's eps_high_prime = 2.0 keeps negatives whose ratio passed 3.

    Metrics: ``rec_dropped_fraction`` (tokens outside the kept region), ``ratio_mean``.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    for name, value, allowed in (("clip", clip, _REC_CLIPS), ("weight", weight, _REC_WEIGHTS),
                                 ("regularizer", regularizer, _REC_REGULARIZERS)):
        if value not in allowed:
            raise ValueError(f"rec: {name} must be one of {', '.join(allowed)}; got {value!r}")
    if temperature <= 0:
        raise ValueError(f"rec: temperature must be > 0, got {temperature}")
    mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT.detach())
    inside_BT = (ratio_BT >= 1 - eps_low) & (ratio_BT <= 1 + eps_high)
    up_BT, down_BT = advantages_BT >= 0, advantages_BT <= 0
    keep_BT = {
        "none": torch.ones_like(mask_BT),
        "two-side": inside_BT,
        "one-side": (up_BT & (ratio_BT <= 1 + eps_high)) | (down_BT & (ratio_BT >= 1 - eps_low)),
        "ring": inside_BT | (up_BT & (ratio_BT <= 1 - eps_low_prime)) | (down_BT & (ratio_BT >= 1 + eps_high_prime)),
    }[clip]
    w_BT = {"none": torch.ones_like(ratio_BT), "ratio": ratio_BT,
            "advantage": torch.exp(advantages_BT.detach() / temperature)}[weight]
    loss_BT = torch.where(keep_BT, -advantages_BT * w_BT * logprobs_BT, torch.zeros_like(logprobs_BT))
    if regularizer == "asymre":
        loss_BT = loss_BT - reg_coef * logprobs_BT
    elif regularizer == "opmd":
        loss_BT = loss_BT + reg_coef * log_ratio_BT**2
    return loss_BT, {"rec_dropped_fraction": masked_mean(~keep_BT, mask_BT), "ratio_mean": masked_mean(ratio_BT, mask_BT)}


class R2vpoLoss:
    """R²VPO: the importance-weighted surrogate with a penalty on the ratio's spread instead of a clip.

    loss = -ρ · A + λ · (ρ - 1)²,   ρ = π_θ / π_old (with gradient), λ from ``x.state``
    after each optimizer step:  λ ← max(0, λ + eta · (V - delta)),   V = token mean of (ρ - 1)²

    "Ratio-Variance Regularized Policy Optimization", arXiv:2601.03320 (and arXiv:2605.26784).
    What the public text pins down: a constraint on the second central moment of the policy ratio
    replaces hard clipping, solved primal-dual. What it does not (only the abstracts are public):
    the ratio's level, the estimator of the moment, and δ, η, λ0. This implementation's reading:
    the ratio is per token; the moment is taken about 1, E[(ρ - 1)²], which equals the central
    moment in expectation because E_{π_old}[ρ] = 1, and which keeps the loss a per-token sum (so
    micro-batching does not change it); the dual variable takes one projected gradient-ascent
    step per optimizer step. delta = 0.01, eta = 1, lam_init = 1 are rlvr's choices, not the
    paper's. The paper's down-weighting of stale replayed samples is not implemented here (pair
    with ``algo.offpolicy`` for replay).

    Metrics: ``r2vpo_lambda`` (λ used for this batch), ``r2vpo_variance`` (the token mean of (ρ-1)²).
    """

    def __call__(self, x: LossInputs, *, delta: float = 0.01, eta: float = 1.0,
                 lam_init: float = 1.0) -> tuple[Tensor, dict[str, Tensor]]:
        if delta < 0 or eta < 0 or lam_init < 0:
            raise ValueError(f"r2vpo: need delta, eta, lam_init >= 0; got {delta}, {eta}, {lam_init}")
        lam = float(x.state.setdefault("lam", lam_init))
        mask_BT, logprobs_BT, advantages_BT, log_ratio_BT = masked_inputs(x.logprobs, x.old, x.advantages, x.mask)
        ratio_BT = torch.exp(log_ratio_BT)
        spread_BT = (ratio_BT - 1.0) ** 2
        loss_BT = torch.where(mask_BT, -ratio_BT * advantages_BT + lam * spread_BT, torch.zeros_like(ratio_BT))
        # float64: the dual step reads this mean, and float32 sums would make λ depend on micro-batching
        return loss_BT, {"r2vpo_lambda": torch.tensor(lam), "r2vpo_variance": masked_mean(spread_BT.double(), mask_BT),
                         "ratio_mean": masked_mean(ratio_BT, mask_BT)}

    def after_step(self, state: dict[str, float], means: dict[str, float], *, delta: float = 0.01,
                   eta: float = 1.0, lam_init: float = 1.0) -> None:
        """The dual ascent after an optimizer step, from the step's token-mean metrics."""
        lam = float(state.get("lam", lam_init))
        state["lam"] = max(0.0, lam + eta * (means["r2vpo_variance"] - delta))


r2vpo_loss = R2vpoLoss()


def nft_loss(
    x: LossInputs,
    *,
    accuracy_clamp: float = 0.02,
    negative_clamp: float = 1.0,
    prompt_weight: str = "dr_grpo",
    max_log_ratio: float = 10.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """NFT, negative-aware fine-tuning: likelihood on correct answers, and on wrong ones the
    likelihood of an implicit negative policy.

    r = the group's accuracy clamped to [accuracy_clamp, 1 - accuracy_clamp]; ρ = π_θ / π_old per token
    correct tokens:  loss = -log ρ
    wrong tokens:    loss = -log max_v((1 - r·ρ) / (1 - r), negative_clamp)
                     (π⁻ = (π_old - r·π_θ)/(1 - r) is the negative policy the model implies; max_v
                     clamps the value but passes the gradient through unchanged)
    times the prompt weight (1 - r) ("dr_grpo"), sqrt((1 - r)/r) ("grpo") or 1 ("none").

    Chen et al., "Bridging Supervised Learning and Reinforcement Learning in Math Reasoning",
    arXiv:2505.18116; the formula and defaults follow the authors' code (NVlabs/NFT,
    ``dp_actor.py``: token-level ratio with log ρ capped at 10, clamp_negative = 1.0,
    normalize = 1, r clamped to [0.02, 0.98]). On-policy (ρ = 1) the gradient is Dr.GRPO's with
    A = correct - r: correct tokens get -(1 - r)∇log π, wrong ones +r∇log π. The advantages
    argument is not used: NFT's signal is correctness and the group's accuracy (filled in by the
    loop from the first reward function). NFT trains only on groups with both outcomes (the paper
    filters the rest with dynamic sampling); groups that are all correct or all wrong get zero
    loss here. NFT's code sums the loss over tokens with a constant divisor: use
    ``algo.aggregation = "seq-mean-token-sum-norm"`` for that reduction.

    Metrics: ``nft_negative_clamped_fraction`` (wrong-answer tokens whose value was clamped).
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not 0.0 < accuracy_clamp < 0.5:
        raise ValueError(f"nft: accuracy_clamp must be in (0, 0.5), got {accuracy_clamp}")
    if prompt_weight not in ("dr_grpo", "grpo", "none"):
        raise ValueError(f"nft: prompt_weight must be dr_grpo, grpo or none; got {prompt_weight!r}")
    group_accuracy_BT = x.need("group_accuracy")
    mixed_BT = (group_accuracy_BT > 0) & (group_accuracy_BT < 1)
    mask_BT, logprobs_BT, _, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT,
                                                    mask_BT.bool() & mixed_BT)
    r_BT = group_accuracy_BT.clamp(accuracy_clamp, 1 - accuracy_clamp).to(logprobs_BT.dtype)
    log_ratio_BT = log_ratio_BT.clamp(max=max_log_ratio)
    negative_BT = (1 - r_BT * torch.exp(log_ratio_BT)) / (1 - r_BT)
    floored_BT = negative_BT + (negative_BT.clamp(min=negative_clamp) - negative_BT).detach()
    correct = x.need("correct").bool()
    loss_BT = torch.where(correct, -log_ratio_BT, -torch.log(torch.where(correct, 1.0, floored_BT)))
    weight_BT = {"dr_grpo": 1 - r_BT, "grpo": torch.sqrt((1 - r_BT) / r_BT), "none": torch.ones_like(r_BT)}[prompt_weight]
    loss_BT = torch.where(mask_BT, weight_BT * loss_BT, torch.zeros_like(loss_BT))
    wrong = mask_BT & ~correct
    clamped = wrong & (negative_BT.detach() < negative_clamp)
    return loss_BT, {"nft_negative_clamped_fraction": clamped.sum() / wrong.sum().clamp(min=1),
                     "ratio_mean": masked_mean(torch.exp(log_ratio_BT), mask_BT)}


def luffy_loss(
    x: LossInputs,
    *,
    shaping_gamma: float = 0.1,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[Tensor, dict[str, Tensor]]:
    """LUFFY's mixed-policy loss: PPO's clipped surrogate on the policy's own samples, and on the
    tokens of expert demonstrations mixed into their groups a shaped importance weight without
    clipping.

    on-policy tokens:   ppo_clip_loss (clip_low, clip_high)
    off-policy tokens:  loss = −A · f(r), r = π_θ / π_φ, f(r) = r / (r + γ)

    Yan et al., "Learning to Reason under Off-Policy Guidance", arXiv:2504.14945 (γ = 0.1 there).
    The expert's own probabilities are unknown and taken as π_φ = 1, so the demonstration's
    sampling log-probs are 0 and r = π_θ. The gradient of f is γ·r/(r + γ)² · ∇log π_θ: largest
    for tokens the policy finds unlikely, where plain importance weighting (gradient r·∇log π_θ)
    would nearly vanish; the shaping is what keeps the policy learning from demonstrations that
    are far from its own distribution. ``x.offpolicy`` (filled in by the loop) is 1 on a
    demonstration's tokens. The advantages are GRPO's over the group with its demonstrations.

    Metrics: ``offpolicy_fraction`` (trained tokens from demonstrations) and
    ``offpolicy_prob_mean`` (π_θ of those tokens).
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if shaping_gamma <= 0:
        raise ValueError(f"luffy: shaping_gamma must be > 0, got {shaping_gamma}")
    off_BT = x.need("offpolicy").bool() & mask_BT.bool()
    on_loss_BT, metrics = ppo_clip_loss(replace(x, mask=mask_BT.bool() & ~off_BT), clip_low=clip_low, clip_high=clip_high)
    _, _, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, off_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    off_loss_BT = torch.where(off_BT, -advantages_BT * ratio_BT / (ratio_BT + shaping_gamma), 0.0)
    trained = mask_BT.bool()
    metrics = {**metrics, "offpolicy_fraction": off_BT.sum() / trained.sum().clamp(min=1),
               "offpolicy_prob_mean": masked_mean(ratio_BT.detach(), off_BT)}
    return torch.where(off_BT, off_loss_BT, on_loss_BT), metrics


LOSSES: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "ppo_clip": ppo_clip_loss,
    "pg": pg_loss,
    "cispo": cispo_loss,
    "gspo": gspo_loss,
    "topr": topr_loss,
    "opmd": opmd_loss,
    "bapo": bapo_loss,
    "rec": rec_loss,
    "r2vpo": r2vpo_loss,
    "nft": nft_loss,
    "luffy": luffy_loss,
    "sapo": sapo_loss,
    "gmpo": gmpo_loss,
    "clip_cov": clip_cov_loss,
    "kl_cov": kl_cov_loss,
}
"""Each takes the micro-batch's `LossInputs` and its keyword options (``algo.loss_kwargs``); one
that keeps values across steps is a `StatefulLoss` (R²VPO)."""

LOSS_AGGREGATION: dict[str, str] = {"sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean",
                                     "gspo": "seq-mean-token-mean"}
"""The aggregation a loss's paper defines it with, used when ``algo.aggregation`` is not set
(every other loss: "token-mean"; rlvr 0.2.0 on, before which every loss took "token-mean").
SAPO, GMPO and GSPO are per-sequence objectives averaged over sequences; verl 0.9.1 hard-codes
that mean for SAPO and GMPO, whatever its ``loss_agg_mode``. (GMPO's and GSPO's per-token losses
repeat the row's value, so a token mean would weight rows by their length.)"""

ROW_ADVANTAGE: frozenset[str] = frozenset({"gmpo", "gspo"})
"""Losses that take one advantage per row (GMPO its token mean, as verl's does; GSPO its first
trained token's): a config refuses them with per-token credit (a critic, a teacher, a PRM, turn
credit)."""

ACTS_OFF_POLICY: dict[str, str] = {"kl_cov": "its penalty β·|log ρ| and the penalty's gradient are zero until the "
                                              "policy has moved"}
"""Losses that differ from the policy gradient only once the policy has moved from the one that
sampled (ρ ≠ 1): with one optimizer step per batch they train exactly as −ρA (a run says so)."""
