"""Supervised and preference objectives as pure tensor functions: SFT's token loss (with CHORD's
token weights) and DPO/IPO on sequence log-probabilities.

Shapes: `_BT` per token (zeros where the mask is 0), `_B` per sequence or pair.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor


def sft_token_loss(logprobs_BT: Tensor, mask_BT: Tensor, *, weighting: str = "none") -> Tensor:
    """Per-token negative log-likelihood −w_t · log p_t on the masked tokens (0 elsewhere).

    ``weighting``:
      "none"      w_t = 1: plain SFT (maximum likelihood).
      "chord_phi" w_t = sg(p_t (1 − p_t)): CHORD's token weight (Zhang et al., "On-Policy RL Meets
                  Off-Policy Experts: Harmonizing SFT and RL via Dynamic Weighting",
                  arXiv:2508.11408). Tokens the policy already predicts (p → 1) and tokens it
                  finds very unlikely (p → 0) are down-weighted, so the expert data sharpens
                  without pulling the policy far from its own distribution.
      "sft_is"    w_t = sg(p_t): the importance-weighted variant in the same paper.

    sg is stop-gradient. Aggregate with `rlvr.algos.aggregate_loss`.
    """
    if weighting not in SFT_WEIGHTINGS:
        raise ValueError(f"unknown SFT weighting {weighting!r}; use one of {', '.join(SFT_WEIGHTINGS)}")
    weight_BT = SFT_WEIGHTINGS[weighting](logprobs_BT.detach().exp())
    return torch.where(mask_BT.bool(), -weight_BT * logprobs_BT, torch.zeros_like(logprobs_BT))


SFT_WEIGHTINGS: dict[str, Callable[[Tensor], Tensor]] = {
    "none": torch.ones_like,
    "chord_phi": lambda p: p * (1 - p),
    "sft_is": lambda p: p,
}


def chord_mu(step: int, *, mu_peak: float, mu_valley: float, warmup_steps: int, decay_steps: int) -> float:
    """CHORD's weight μ of the SFT loss at a (0-based) step: L = (1 − μ)·L_RL + μ·L_SFT.

    Linear warm-up from 0 to ``mu_peak`` over ``warmup_steps``, then a cosine decay from
    ``mu_peak`` to ``mu_valley`` over ``decay_steps``, then ``mu_valley``. Zhang et al.,
    arXiv:2508.11408 (the schedule of their released code): imitation first, exploration later.
    """
    if step < warmup_steps:
        return mu_peak * step / warmup_steps
    t = step - warmup_steps
    if t >= decay_steps:
        return mu_valley
    return mu_valley + (mu_peak - mu_valley) * 0.5 * (1 + math.cos(math.pi * t / decay_steps))


def dpo_loss(chosen_B: Tensor, rejected_B: Tensor, ref_chosen_B: Tensor, ref_rejected_B: Tensor, *,
             beta: float = 0.1, kind: str = "sigmoid", label_smoothing: float = 0.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair preference loss from the sequence log-probabilities of the chosen (y_w) and the
    rejected (y_l) answer under the policy and the reference model.

    h = [log π(y_w) − log π_ref(y_w)] − [log π(y_l) − log π_ref(y_l)]

    "sigmoid" (DPO; Rafailov et al., "Direct Preference Optimization", arXiv:2305.18290):
        L = −(1 − ε) log σ(β h) − ε log σ(−β h), where ε = label_smoothing is the assumed share of
        flipped labels (conservative DPO; ε = 0 is plain DPO).
    "ipo" (Azar et al., "A General Theoretical Paradigm to Understand Learning from Human
        Preferences", arXiv:2310.12036): L = (h − 1/(2β))², β the regularisation τ. The squared
        loss regresses the margin to a finite target instead of pushing it to infinity.

    Metrics (means over the pairs): ``preference_accuracy`` (h > 0), ``margin`` (β h), and the
    implicit rewards ``chosen_reward`` = β(log π(y_w) − log π_ref(y_w)) and ``rejected_reward``.
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_ratio_B, rejected_ratio_B = chosen_B - ref_chosen_B, rejected_B - ref_rejected_B
    h_B = chosen_ratio_B - rejected_ratio_B
    if kind == "sigmoid":
        loss_B = -(1 - label_smoothing) * F.logsigmoid(beta * h_B) - label_smoothing * F.logsigmoid(-beta * h_B)
    elif kind == "ipo":
        loss_B = (h_B - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown preference loss {kind!r}; use \"sigmoid\" (DPO) or \"ipo\"")
    with torch.no_grad():
        metrics = {"preference_accuracy": (h_B > 0).float().mean(), "margin": (beta * h_B).mean(),
                   "chosen_reward": (beta * chosen_ratio_B).mean(), "rejected_reward": (beta * rejected_ratio_B).mean()}
    return loss_B, metrics
