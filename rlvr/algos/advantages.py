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
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards_PG must be [P, G], got shape {tuple(rewards_PG.shape)}")
    group_size = rewards_PG.shape[1]
    advantages_PG = rewards_PG - rewards_PG.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        std_P1 = rewards_PG.std(dim=1, keepdim=True)  # unbiased: divisor G - 1
        advantages_PG = advantages_PG / (std_P1 + eps)
    # Rounding in the mean can leave ~1e-8 residues in a constant group, which division by
    # (0 + eps) would blow up to O(1); pin such groups to exactly zero.
    constant_P1 = (rewards_PG == rewards_PG[:, :1]).all(dim=1, keepdim=True)
    return torch.where(constant_P1, torch.zeros_like(advantages_PG), advantages_PG)


ESTIMATORS: dict[str, Callable[..., Tensor]] = {"grpo": group_advantages}
