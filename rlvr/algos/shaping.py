"""Reward shaping by completion length, applied to the step's rewards before the advantages.

Every function takes ``rewards_PG``, ``lengths_PG`` (the tokens the policy sampled: an episode's
injected observations do not count), ``correct_PG`` (the first reward function gave full marks)
and ``max_tokens`` (the generation budget: an episode's is env.max_total_tokens), plus keyword
arguments, and returns ``(shaped_rewards_PG, metrics)``. Shaping functions are chained in the
order the config lists them (``[[algo.shaping]]``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def overlong_penalty(
    rewards_PG: Tensor, lengths_PG: Tensor, correct_PG: Tensor, max_tokens: int, *, cache: int = 16
) -> tuple[Tensor, dict[str, float]]:
    """DAPO's soft overlong punishment: a penalty growing linearly over the last `cache` tokens.

    R_length(|y|) = 0                                  if |y| <= L_max - cache
                  = ((L_max - cache) - |y|) / cache    if L_max - cache < |y| <= L_max
                  = -1                                 if |y| > L_max

    added to the reward, with L_max = ``max_tokens`` (sampling.max_new_tokens). Yu et al., "DAPO:
    An Open-Source LLM Reinforcement Learning System at Scale", arXiv:2503.14476, eq. 13. The
    engine never goes past L_max, so a completion cut at the budget gets exactly -1.
    Metric ``shaping/overlong_fraction``: completions inside the penalty zone.
    """
    if not 0 < cache <= max_tokens:
        raise ValueError(f"overlong cache must be in (0, max_tokens = {max_tokens}], got {cache}")
    start = max_tokens - cache
    lengths = lengths_PG.to(rewards_PG.dtype)
    penalty_PG = torch.where(lengths <= start, torch.zeros_like(lengths), (start - lengths) / cache)
    penalty_PG = torch.where(lengths > max_tokens, torch.full_like(lengths, -1.0), penalty_PG)
    return rewards_PG + penalty_PG, {"shaping/overlong_fraction": float((lengths > start).float().mean())}


def kimi_length_penalty(
    rewards_PG: Tensor, lengths_PG: Tensor, correct_PG: Tensor, max_tokens: int, *, weight: float = 1.0
) -> tuple[Tensor, dict[str, float]]:
    """Kimi k1.5's length reward, per group: shorter than the group's middle length is rewarded.

    λ_i = 0.5 - (len_i - min_len) / (max_len - min_len)        (0 when all lengths are equal)
    len_reward_i = λ_i if correct, min(0, λ_i) if not;   r_i += weight · len_reward_i

    Kimi Team, "Kimi k1.5: Scaling Reinforcement Learning with LLMs", arXiv:2501.12599, §2.3.3
    (min/max over the group's sampled responses). Wrong answers are never rewarded for brevity.
    """
    lengths = lengths_PG.to(rewards_PG.dtype)
    low, high = lengths.min(dim=1, keepdim=True).values, lengths.max(dim=1, keepdim=True).values
    spread = (high - low).clamp(min=1e-12)
    lam_PG = torch.where(high > low, 0.5 - (lengths - low) / spread, torch.zeros_like(lengths))
    bonus_PG = torch.where(correct_PG, lam_PG, lam_PG.clamp(max=0.0))
    return rewards_PG + weight * bonus_PG, {"shaping/length_reward_mean": float(bonus_PG.mean())}


SHAPING: dict[str, Callable[..., tuple[Tensor, dict[str, float]]]] = {
    "overlong": overlong_penalty,
    "kimi_length": kimi_length_penalty,
}
