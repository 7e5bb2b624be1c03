"""Mass-covering divergences to the initial policy, estimated on samples drawn from it (DPH-RL).

Each function takes ``(logprobs_BT, init_logprobs_BT, mask_BT)``: log π_θ (with gradient) and
log π_0 of tokens that π_0 sampled, and returns ``(loss_BT, metrics)``, 0 at masked positions.
With u = π_θ / π_0 per token, an f-divergence between π_0 and π_θ is E_{π_0}[f(u)] for a convex f
with f(1) = 0, so it needs no online reference model: only the stored samples and their π_0
log-probs (rlvr.train.rehearsal).

Li et al., "The Choice of Divergence: A Neglected Key to Mitigating Diversity Collapse in
Reinforcement Learning with Verifiable Reward", arXiv:2509.07430. Reverse KL (the usual
``algo.kl_coef`` term) is mode-seeking and speeds the collapse of pass@k; forward KL and
Jensen-Shannon against the initial policy keep mass on what it could already solve, acting as
rehearsal. The forms below follow the authors' code (seamoke/DPH-RL, ``core_algos.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlvr.algos.masked import masked_mean


def _log_u(logprobs_BT: Tensor, init_logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    mask_BT = mask_BT.bool()
    return mask_BT, torch.where(mask_BT, logprobs_BT - init_logprobs_BT, torch.zeros_like(logprobs_BT))


def forward_kl(logprobs_BT: Tensor, init_logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """KL(π_0 ‖ π_θ) per token as  u - log u - 1  (the k3 form; ≥ 0, 0 at u = 1).

    Its gradient is (u - 1)∇log π_θ: where π_θ lost probability on what π_0 produced (u < 1) it
    pushes it back up, like SFT on the stored samples, but it stops once π_θ matches π_0.
    Metric ``divergence_ratio_mean``: mean u.
    """
    mask_BT, log_u_BT = _log_u(logprobs_BT, init_logprobs_BT, mask_BT)
    u_BT = torch.exp(log_u_BT)
    loss_BT = torch.where(mask_BT, u_BT - log_u_BT - 1.0, torch.zeros_like(u_BT))
    return loss_BT, {"divergence_ratio_mean": masked_mean(u_BT, mask_BT)}


def jensen_shannon(logprobs_BT: Tensor, init_logprobs_BT: Tensor, mask_BT: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Jensen-Shannon through its generator,  f(u) = u log u - (u + 1) log((u + 1)/2)  (≥ 0, 0 at u = 1).

    E_{π_0}[f(π_θ/π_0)] = 2·JS(π_0, π_θ). As u → 0, f(u) → log 2: a stored sample that π_θ now
    finds very unlikely costs at most log 2 per token, so forgetting one cannot dominate the term
    (forward KL grows like -log u there).
    The gradient is u·log(2u/(u + 1))∇log π_θ. Metric ``divergence_ratio_mean``: mean u.
    """
    mask_BT, log_u_BT = _log_u(logprobs_BT, init_logprobs_BT, mask_BT)
    u_BT = torch.exp(log_u_BT)
    f_BT = u_BT * log_u_BT - (u_BT + 1.0) * (torch.log1p(u_BT) - math.log(2.0))
    loss_BT = torch.where(mask_BT, f_BT, torch.zeros_like(u_BT))
    return loss_BT, {"divergence_ratio_mean": masked_mean(u_BT, mask_BT)}


DIVERGENCES: dict[str, Callable[[Tensor, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]] = {
    "forward_kl": forward_kl,
    "js": jensen_shannon,
}
