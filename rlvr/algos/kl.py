"""Per-token estimators of KL(pi_theta || pi_ref) from tokens sampled from pi_theta.

Schulman, "Approximating KL Divergence", http://joschu.net/blog/kl-approx.html.
With the log-ratio  log r = log pi_ref(x) - log pi_theta(x),  x ~ pi_theta:

    k1 = -log r                  unbiased, high variance, negative on some tokens
    k2 = (log r)^2 / 2           biased, low variance, >= 0
    k3 = (r - 1) - log r         unbiased, low variance, >= 0  (GRPO's choice)

Every function takes ``(logprobs_BT, ref_logprobs_BT)`` and returns ``kl_BT``, all [B, T];
gradients flow through ``logprobs_BT``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def kl_k1(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k1 = log pi_theta - log pi_ref (Schulman, "Approximating KL Divergence")."""
    return logprobs_BT - ref_logprobs_BT


def kl_k2(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k2 = (log pi_theta - log pi_ref)^2 / 2 (Schulman, "Approximating KL Divergence")."""
    return 0.5 * (logprobs_BT - ref_logprobs_BT) ** 2


def kl_k3(logprobs_BT: Tensor, ref_logprobs_BT: Tensor) -> Tensor:
    """k3 = exp(log pi_ref - log pi_theta) - (log pi_ref - log pi_theta) - 1.

    Schulman, "Approximating KL Divergence"; the per-token KL penalty of GRPO (Shao et al.,
    "DeepSeekMath", arXiv:2402.03300, eq. 4). Non-negative since e^x >= 1 + x.
    """
    log_ratio_BT = ref_logprobs_BT - logprobs_BT
    return torch.exp(log_ratio_BT) - log_ratio_BT - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
