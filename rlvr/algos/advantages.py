"""Outcome advantage estimators: one reward per completion, one advantage per completion.

Shapes: ``_P`` prompts, ``_G`` completions sampled per prompt (the group).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def group_advantages(
    rewards_PG: Tensor, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO group-relative advantages.

    A_pg = (r_pg - mean_g r_pg) / (std_g r_pg + eps)   if normalize_std
    A_pg =  r_pg - mean_g r_pg                          otherwise

    GRPO: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models", arXiv:2402.03300. ``std_g`` is the unbiased sample standard deviation
    over the group (divisor G - 1, ``torch.std``'s default), as in DeepSeekMath's reference
    implementation and TRL.

    ``normalize_std=False`` is Dr.GRPO: Liu et al., "Understanding R1-Zero-Like Training: A
    Critical Perspective", arXiv:2503.20783. Dividing by std up-weights groups whose rewards
    barely differ (questions that are nearly always or nearly never solved).

    A group whose rewards are all equal, including a group of one (G = 1, where the sample
    std is undefined), has exactly zero advantage: it carries no ranking signal.

    Args:
        rewards_PG: float rewards, [P, G].
    Returns:
        advantages_PG: [P, G].
    """
    _check_PG(rewards_PG)
    group_size = rewards_PG.shape[1]
    advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std_P1 = rewards_PG.std(dim=1, keepdim=True)  # unbiased: divisor G - 1
        advantages_PG = advantages_PG / (std_P1 + eps)
    # Rounding in the mean can leave ~1e-8 residues in a constant group, which division by
    # (0 + eps) would blow up to O(1); pin such groups to exactly zero.
    return torch.where(_constant_groups(rewards_PG), torch.zeros_like(advantages_PG), advantages_PG)


def dr_grpo_advantages(rewards_PG: Tensor) -> Tensor:
    """Dr.GRPO: A_pg = r_pg - mean_g r_pg, no division by the group std.

    Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    The same as ``grpo`` with ``normalize_std=False``; a name of its own so recipes read plainly.
    """
    return group_advantages(rewards_PG, normalize_std=False)


def rloo_advantages(rewards_PG: Tensor) -> Tensor:
    """REINFORCE leave-one-out: each sample's baseline is the mean reward of the other G - 1.

    A_pg = r_pg - 1/(G-1) Σ_{j≠g} r_pj = G/(G-1) · (r_pg - mean_g r_pg)

    Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (ICLR 2019 workshop);
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", arXiv:2402.14740. The baseline does not depend on the sample
    itself, so the gradient estimate stays unbiased. G = 1 has no other sample: advantage 0.
    """
    _check_PG(rewards_PG)
    group = rewards_PG.shape[1]
    if group == 1:
        return torch.zeros_like(rewards_PG)
    centered_PG = group_advantages(rewards_PG, normalize_std=False)
    return centered_PG * (group / (group - 1))


def reinforce_pp_advantages(rewards_PG: Tensor, *, group_baseline: bool = True, eps: float = 1e-6) -> Tensor:
    """REINFORCE++: advantages whitened over the whole batch instead of within each group.

    x_pg = r_pg - mean_g r_pg   (group_baseline, "REINFORCE++-baseline")   or   x_pg = r_pg
    A_pg = (x_pg - mean_batch x) / (std_batch x + eps)

    Hu et al., "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and
    Reward Models", arXiv:2501.03262 (the baseline variant is the one for G > 1 samples per
    prompt). std is the unbiased sample std over all P·G values. With ``group_baseline`` a group
    whose rewards are all equal keeps advantage exactly 0; without it, it does not (plain
    REINFORCE++ is meant for one sample per prompt). The paper also subtracts a per-token KL from
    the reward; rlvr's KL terms are separate (``algo.kl_coef``).
    """
    _check_PG(rewards_PG)
    x_PG = group_advantages(rewards_PG, normalize_std=False) if group_baseline else rewards_PG
    if x_PG.numel() < 2:
        return torch.zeros_like(x_PG)
    out_PG = (x_PG - x_PG.mean()) / (x_PG.std() + eps)
    if group_baseline:
        out_PG = torch.where(_constant_groups(rewards_PG), torch.zeros_like(out_PG), out_PG)
    return out_PG


def lite_ppo_advantages(rewards_PG: Tensor, *, eps: float = 1e-6) -> Tensor:
    """LitePPO: the group's mean as baseline, the batch's reward std as scale.

    A_pg = (r_pg - mean_g r_pg) / (std_batch r + eps)

    Liu et al., "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221 (group-level mean, batch-level std; with token-level loss aggregation it beat
    GRPO and DAPO there). std is the unbiased sample std of all P·G rewards. Unlike GRPO, a
    group with nearly equal rewards is not blown up to unit scale.
    """
    _check_PG(rewards_PG)
    centered_PG = group_advantages(rewards_PG, normalize_std=False)
    if rewards_PG.numel() < 2:
        return centered_PG
    return centered_PG / (rewards_PG.std() + eps)


def bnpo_advantages(
    rewards_PG: Tensor, *, min_reward: float = 0.0, max_reward: float = 1.0, max_weight: float = 1e6
) -> Tensor:
    """BNPO: the group-mean baseline, scaled by the inverse of a Beta density fitted to the batch.

    s_pg = (r_pg - min_reward) / (max_reward - min_reward)        rewards mapped to [0, 1]
    p_p  = mean_g s_pg                                             (0 when G = 1)
    m, v = mean and unbiased variance of p_p over the batch's prompts
    a = (m(1 - m)/v - 1)·m,  b = (m(1 - m)/v - 1)·(1 - m)          method of moments
    α = max(1, 1 + a/3),  β = max(1, 1 + b/3)
    A_pg = min(1 / Beta(p_p; α, β), max_weight) · (s_pg - p_p)

    Xiao et al., "BNPO: Beta Normalization Policy Optimization", arXiv:2506.02864; the fit and
    the clamp follow the authors' code (changyi7231/BNPO, ``compute_bnpo_outcome_advantage``).
    With binary rewards, α = β = 1 is REINFORCE with a group-mean baseline, and α = β = 3/2
    weights by 1/√(p(1-p)) like GRPO. With one prompt, or prompts that all have the same mean
    (v = 0), there is nothing to fit and α = β = 1 is used. Name clash: TRL's and ms-swift's
    ``loss_type="bnpo"`` is a loss aggregation, unrelated to this estimator.
    """
    _check_PG(rewards_PG)
    if max_reward <= min_reward:
        raise ValueError(f"max_reward must exceed min_reward, got [{min_reward}, {max_reward}]")
    scores_PG = (rewards_PG.double() - min_reward) / (max_reward - min_reward)
    if scores_PG.min() < 0 or scores_PG.max() > 1:
        raise ValueError(
            f"BNPO needs rewards inside [min_reward, max_reward] = [{min_reward}, {max_reward}]; "
            f"got [{float(rewards_PG.min())}, {float(rewards_PG.max())}]; set algo.advantage_kwargs"
        )
    if scores_PG.shape[1] > 1:
        p_P1 = scores_PG.mean(dim=1, keepdim=True)
    else:
        p_P1 = torch.zeros_like(scores_PG)
    alpha = beta = torch.tensor(1.0, dtype=torch.float64)
    if p_P1.shape[0] > 1 and p_P1.var() > 0:
        m, v = p_P1.mean(), p_P1.var()
        common = m * (1 - m) / v - 1
        alpha = torch.clamp(1 + common * m / 3, min=1.0)
        beta = torch.clamp(1 + common * (1 - m) / 3, min=1.0)
    density_P1 = torch.distributions.Beta(alpha, beta).log_prob(p_P1.clamp(1e-12, 1 - 1e-12)).exp()
    weight_P1 = torch.clamp(1 / density_P1, max=max_weight)
    advantages_PG = weight_P1 * (scores_PG - p_P1)
    if scores_PG.shape[1] > 1:  # a constant group has no signal (G = 1 has no baseline at all)
        advantages_PG = torch.where(_constant_groups(rewards_PG), torch.zeros_like(advantages_PG), advantages_PG)
    return advantages_PG.to(rewards_PG.dtype)


def remax_advantages(rewards_PG: Tensor, *, baseline_P: Tensor) -> Tensor:
    """ReMax: each prompt's baseline is the reward of its greedy completion.

    A_pg = r_pg - r(x_p, ŷ_p),   ŷ_p = the greedy (temperature 0) completion of prompt p

    Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", arXiv:2310.10505. The training loop samples and scores the
    greedy completion itself whenever this estimator is selected (one extra greedy sample per
    prompt, logged as ``greedy_reward``); ``baseline_P`` is not a config setting. Unlike the group
    baselines, a group whose samples all differ from the greedy answer's reward has signal,
    which is what makes ReMax work with G = 1.
    """
    _check_PG(rewards_PG)
    if baseline_P.shape != rewards_PG.shape[:1]:
        raise ValueError(f"baseline_P must be [P] = [{rewards_PG.shape[0]}], got {tuple(baseline_P.shape)}")
    return rewards_PG - baseline_P.to(rewards_PG.dtype)[:, None]


def _check_PG(rewards_PG: Tensor) -> None:
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards_PG must be [P, G], got shape {tuple(rewards_PG.shape)}")


def _constant_groups(rewards_PG: Tensor) -> Tensor:
    """[P, 1] True where every reward of the group is equal."""
    return (rewards_PG == rewards_PG[:, :1]).all(dim=1, keepdim=True)


ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "grpo": group_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "lite_ppo": lite_ppo_advantages,
    "bnpo": bnpo_advantages,
    "remax": remax_advantages,
}

LOOP_INPUTS = ("baseline_P",)
"""Estimator keywords the training loop fills in (never set from the config):
baseline_P = the reward of each prompt's greedy completion (Group.metadata["greedy_reward"])."""
