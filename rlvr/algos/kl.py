"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
With the log-ratio  log r = log pi_ref(x) - log pi_theta(x),  x ~ pi_theta:

    k1 = -log r                  unbiased, high variance, negative on some tokens
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0  (GRPO's choice)

Every function takes ``(logprobs_BT, ref_logprobs_BT, old_logprobs_BT)`` and returns ``kl_BT``,
all [B, T]; gradients flow through ``logprobs_BT``. ``old_logprobs_BT``, the log-probs the PPO
ratio is taken against, is read by the ratio-weighted estimator alone (None: not given).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, old_logprobs_BT: Tensor | None = None) -> Tensor:
    """k1 = log pi_theta - log pi_ref (Schulman, "Approximating KL Divergence")."""
    return logprobs_BT - ref_logprobs_BT


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, old_logprobs_BT: Tensor | None = None) -> Tensor:
    """k2 = (log pi_theta - log pi_ref)^2 / 2 (Schulman, "Approximating KL Divergence")."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, old_logprobs_BT: Tensor | None = None) -> Tensor:
    """k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1.

    Schulman, "Approximating KL Divergence"; the per-token KL penalty of GRPO (Shao et al.,
    "DeepSeekMath", arXiv:2402.03300, eq. 4). Non-negative since e^x >= 1 + x.
    """
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


def kl_k3_ratio(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, old_logprobs_BT: Tensor | None = None) -> Tensor:
    """k3 weighted by the ratio π_θ/π_old: 1 in value on-policy, but not in gradient, where it
    makes the term's gradient the reverse KL's instead of k3's biased one, which gives tokens
    with π_θ ≪ π_ref large, unbounded weights.

    DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models",
    arXiv:2512.02556, Eq. 7; TRL 1.16's default (``use_bias_correction_kl``).
    """
    if old_logprobs_BT is None:
        raise ValueError("the k3_ratio KL estimator needs the log-probs the PPO ratio is taken against")
    return torch.exp(logprobs_BT - old_logprobs_BT) * kl_k3(logprobs_BT, ref_logprobs_BT)


KL_ESTIMATORS: dict[str, Callable[..., Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
    "k3_ratio": kl_k3_ratio,
}


@dataclass(frozen=True)
class AdaptiveKL:
    """``algo.kl_adaptive``: the controller's target KL per sample (summed over its tokens) and
    its horizon in samples (rlvr.algos.kl.KLController)."""

    target: float
    horizon: int = 10000

    def __post_init__(self) -> None:
        if not (self.target > 0 and self.horizon >= 1):
            raise ValueError(f"need target > 0 and horizon >= 1, got {self.target}, {self.horizon}")


class KLController:
    """The KL coefficient β, fixed or adapted toward a target KL (Ziegler et al.).

    With ``target`` set, after each step with observed KL ``kl`` over ``n`` samples:
        e = clip(kl / target - 1, -0.2, 0.2),   β ← β · (1 + e · n / horizon)
    Ziegler et al., "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593, §2.2
    (a proportional controller; the ±0.2 clip and horizon 10000 are the defaults TRL's legacy
    PPO and verl's AdaptiveKLController use). ``kl`` is the mean per-sample (summed over tokens)
    KL of the step. Without a target, β stays at its initial value.
    """

    def __init__(self, coef: float, target: float | None = None, horizon: int = 10000) -> None:
        if coef < 0 or (target is not None and target <= 0) or horizon < 1:
            raise ValueError(f"need coef >= 0, target > 0 or None, horizon >= 1; got {coef}, {target}, {horizon}")
        self.value, self.target, self.horizon = coef, target, horizon

    def update(self, kl: float, n: int) -> None:
        if self.target is None or kl != kl:  # fixed, or no KL measured this step (NaN)
            return
        error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])
