"""Entropy control: losses that keep a few high-covariance tokens from collapsing the policy's
entropy (Clip-Cov, KL-Cov), and the selection of the high-entropy "forking" tokens that carry
the policy gradient.

Cui et al., "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
arXiv:2505.22617: under (natural) policy gradient, the change of the policy's entropy is
minus the covariance between the tokens' log-probabilities and their advantages (for a plain
softmax policy gradient, with the advantage weighted by the token's probability). A confident
token with a high advantage lowers the entropy, so limiting the update of the few tokens with the
largest covariance keeps the entropy, and the exploration, from collapsing early in training.

Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement
Learning for LLM Reasoning", arXiv:2506.01939: training only on the ~20% of tokens with the
highest entropy matches or beats training on all of them.

The losses return ``(loss_BT, metrics)`` like rlvr.algos.losses; aggregation is separate.
Shapes: ``_B`` sequences, ``_T`` tokens; ``mask_BT`` is 1/True on trained tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from rlvr.algos.inputs import LossInputs
from rlvr.algos.masked import masked_inputs, masked_mean


def check_top(top: float) -> None:
    """The share of tokens the high-entropy selection keeps: in (0, 1]."""
    if not 0.0 < top <= 1.0:
        raise ValueError(f"top must be in (0, 1], got {top}")


@dataclass(frozen=True)
class EntropyOptions:
    """``algo.entropy``: the entropy bonus and the high-entropy token selection."""

    coef: float = 0.0
    """Weight of the entropy bonus, −coef·H per trained token in the loss."""
    top: float = 1.0
    """The fraction of each forward pass's trained tokens, by highest entropy, that the policy
    loss trains (high_entropy_tokens; 1 = all, 0.2 in arXiv:2506.01939). The selection is the
    policy loss's mask: a loss with a statistic over the row (GSPO's and GMPO's sequence ratio)
    takes it over the selected tokens, so no other token gets a policy gradient. A KL term and the
    bonus still see every trained token, and the aggregation's token counts are unchanged."""

    def __post_init__(self) -> None:
        check_top(self.top)


def token_covariance(logprobs_BT: Tensor, advantages_BT: Tensor, mask_BT: Tensor) -> Tensor:
    """Each trained token's centred product (log π − mean log π)·(A − mean A), means over the
    trained tokens of the batch; detached, and −inf at masked positions (never selected)."""
    mask_BT = mask_BT.bool()
    logprobs_BT, advantages_BT = logprobs_BT.detach(), advantages_BT.detach()
    n = mask_BT.sum().clamp(min=1)
    mean_logprob = torch.where(mask_BT, logprobs_BT, 0.0).sum() / n
    mean_advantage = torch.where(mask_BT, advantages_BT, 0.0).sum() / n
    covariance_BT = (logprobs_BT - mean_logprob) * (advantages_BT - mean_advantage)
    return torch.where(mask_BT, covariance_BT, float("-inf"))


def clip_cov_loss(
    x: LossInputs,
    *,
    clip_ratio: float = 2e-4,
    cov_low: float = 1.0,
    cov_high: float = 5.0,
    clip_low: float = 1.0,
    clip_high: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clip-Cov: PPO's clipped loss, with the gradient of a few high-covariance tokens cut.

    cov_t  = (log π_θ(y_t) − mean log π_θ)·(A_t − mean A)          (token_covariance)
    candidates: trained tokens with cov_low < cov_t < cov_high that PPO's clip left alone
    chosen:     k = `chosen_count`(clip_ratio·N) candidates drawn uniformly at random (N: trained tokens)
    loss_t = max(−A_t·r_t, −A_t·clip(r_t, 1 − clip_low, 1 + clip_high)), and 0 where chosen

    arXiv:2505.22617 (Cui et al.), Section 4 ("Clip-Cov"). The draws use torch's global random
    generator, which rlvr seeds from the run's seed and keeps in every checkpoint. The means and
    N are over the tokens the loss sees in one forward pass (a micro-batch; groups whose
    advantages are all zero are not run, see rlvr.train.update), as in verl. Departure from verl:
    verl chooses max(1, ⌊clip_ratio·N⌋) per pass, at least one token in every micro-batch (with
    1,024-token micro-batches and the recipe's 2e-4, five times the recipe's share, and a share
    that grows as micro-batches shrink); `chosen_count` rounds clip_ratio·N up or down at random
    with the fraction as probability, so the number chosen is clip_ratio·N in expectation
    however the batch is cut (issue 50). Defaults are the
    authors' Clip-Cov recipes (recipe/dapo/7b_clip_cov.sh and 32b_clip_cov.sh in their
    repository, PRIME-RL/Entropy-Mechanism-of-RL): clip_ratio 2e-4, bounds 1 and 5, and PPO's
    clip opened to clip_low = clip_high = 1 (the ratio clamped to [0, 2], so that the covariance
    cut, not the clip, is the trust region). verl 0.9.1's ``compute_policy_loss_clip_cov`` has
    the same formula and takes the actor's clip (0.2 by default there); it is the numeric check
    (docs/algorithms.md), run with a clip of 0.2 so that the clip's exclusion is exercised.

    Metrics: ``cov_clipped_fraction`` (trained tokens chosen), ``clip_fraction`` (PPO's clip
    active), ``ratio_mean``.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not 0.0 < clip_ratio <= 1.0:
        raise ValueError(f"clip_ratio must be in (0, 1], got {clip_ratio}")
    if cov_low >= cov_high:
        raise ValueError(f"cov_low must be below cov_high, got {cov_low}, {cov_high}")
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")
    mask_BT, _, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    loss_BT = -advantages_BT * ratio_BT
    clipped_loss_BT = -advantages_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped_BT = (clipped_loss_BT > loss_BT) & mask_BT
    covariance_BT = token_covariance(logprobs_BT, advantages_BT, mask_BT)
    candidates = torch.nonzero(mask_BT & ~clipped_BT & (covariance_BT > cov_low) & (covariance_BT < cov_high))
    if len(candidates):  # (no draw from the generator when there is nothing to draw, as in verl)
        k = chosen_count(clip_ratio * int(mask_BT.sum()))
        candidates = candidates[torch.randperm(len(candidates))[:k]]
    keep_BT = torch.ones_like(mask_BT)
    keep_BT[candidates[:, 0], candidates[:, 1]] = False
    loss_BT = torch.where(mask_BT & keep_BT, torch.maximum(loss_BT, clipped_loss_BT), 0.0)
    metrics = {"cov_clipped_fraction": masked_mean(~keep_BT, mask_BT), "clip_fraction": masked_mean(clipped_BT, mask_BT),
               "ratio_mean": masked_mean(ratio_BT, mask_BT)}
    return loss_BT, metrics


def chosen_count(expected: float) -> int:
    """How many tokens Clip-Cov chooses in a pass that should choose ``expected`` (clip_ratio·N):
    ⌊expected⌋, plus one with probability expected − ⌊expected⌋ (a draw from torch's global
    generator, made only where the fraction is not 0). Its mean is ``expected``, so a batch cut
    into micro-batches chooses clip_ratio times its tokens on average, as one pass over it would."""
    whole = math.floor(expected)
    fraction = expected - whole
    if fraction > 0 and float(torch.rand(())) < fraction:
        whole += 1
    return whole


def kl_cov_loss(
    x: LossInputs,
    *,
    kl_ratio: float = 2e-3,
    kl_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL-Cov: the unclipped surrogate, plus a KL penalty on the tokens of largest covariance.

    cov_t  = (log π_θ(y_t) − mean log π_θ)·(A_t − mean A)          (token_covariance)
    chosen: the max(1, ⌊kl_ratio·N⌋) trained tokens of largest cov_t
    loss_t = −A_t·r_t, plus kl_coef·|log r_t| where chosen            (r_t = π_θ / π_old)

    arXiv:2505.22617 (Cui et al.), Section 4 ("KL-Cov"). No ratio clip: the penalty is the
    trust region, and only on the chosen tokens. Means and N are over one forward pass's tokens,
    as for clip_cov_loss. Defaults are the authors' Qwen2.5-7B recipe (recipe/dapo/7b_kl_cov.sh
    in their repository: k = 0.2%, coefficient 1; verl's config defaults are 2e-4 and 0.1).
    Checked against verl 0.9.1's ``compute_policy_loss_kl_cov`` (docs/algorithms.md).

    Metrics: ``cov_penalised_fraction`` (trained tokens chosen), ``kl_abs_mean`` (mean |log r|),
    ``ratio_mean``.
    """
    logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = x.logprobs, x.old, x.advantages, x.mask
    if not 0.0 < kl_ratio <= 1.0:
        raise ValueError(f"kl_ratio must be in (0, 1], got {kl_ratio}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    mask_BT, _, advantages_BT, log_ratio_BT = masked_inputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT)
    ratio_BT = torch.exp(log_ratio_BT)
    covariance_BT = token_covariance(logprobs_BT, advantages_BT, mask_BT).flatten()
    n = int(mask_BT.sum())
    chosen_BT = torch.zeros_like(mask_BT)
    if n:
        chosen_BT.view(-1)[torch.topk(covariance_BT, max(1, int(kl_ratio * n))).indices] = True
    penalty_BT = torch.where(chosen_BT, kl_coef * log_ratio_BT.abs(), 0.0)
    loss_BT = torch.where(mask_BT, -advantages_BT * ratio_BT + penalty_BT, 0.0)
    metrics = {"cov_penalised_fraction": masked_mean(chosen_BT, mask_BT),
               "kl_abs_mean": masked_mean(log_ratio_BT.abs(), mask_BT), "ratio_mean": masked_mean(ratio_BT, mask_BT)}
    return loss_BT, metrics


def high_entropy_tokens(entropy_BT: Tensor, mask_BT: Tensor, top: float) -> Tensor:
    """The trained tokens whose entropy is among the top fraction ``top`` of the trained tokens'
    (bool, [B, T]): entropy ≥ the (1 − top)-quantile, with linear interpolation between order
    statistics (torch.quantile's default, as TRL's ``top_entropy_quantile``). Ties at the
    threshold all stay, so slightly more than ``top`` may. ``top = 1`` keeps every trained token.

    Wang et al., arXiv:2506.01939 (they keep the top 20%: ``top = 0.2``), applied per forward pass
    over its trained tokens, as TRL applies it per micro-batch."""
    check_top(top)
    mask_BT = mask_BT.bool()
    if top == 1.0 or not mask_BT.any():
        return mask_BT
    entropy_BT = entropy_BT.detach().float()
    threshold = torch.quantile(entropy_BT[mask_BT], 1.0 - top)
    return mask_BT & (entropy_BT >= threshold)
