"""Off-policy corrections between the engine that sampled and the learner that trains.

The engine's log-probabilities μ (returned with every sampled token) and the learner's π_old for
the same tokens differ even with identical weights: different kernels, batch shapes and
precision (or on purpose: top-k/top-p sampling, a quantised or stale engine). The token-level
policy-gradient surrogate assumes they are equal (Qwen team, "Stabilizing Reinforcement
Learning with LLMs: Formulation and Practices", arXiv:2512.01374). A correction reweights each
token's loss by a detached importance weight built from ρ = π_old / μ.

Every function takes a micro-batch's `LossInputs` (rlvr.algos.inputs: π_old is ``x.old``, μ is
``x.sampler``) and its keyword options, and returns ``(weights_BT, metrics)``; weights are 0 at
masked positions and carry no gradient. OPSM also reads ``x.advantages`` and ``x.logprobs``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from rlvr.algos.inputs import LossInputs
from rlvr.algos.masked import log_ratio, masked_mean


def no_correction(x: LossInputs) -> tuple[Tensor, dict[str, Tensor]]:
    """Weight 1 on every trained token (the on-policy assumption)."""
    return x.mask.to(x.old.dtype), {}


def truncated_is(
    x: LossInputs, *, cap: float = 2.0, level: str = "token"
) -> tuple[Tensor, dict[str, Tensor]]:
    """Truncated importance sampling: w = min(ρ, cap).

    Ionides, "Truncated Importance Sampling", J. Comp. Graph. Stat. 17 (2008); applied to the
    engine/learner mismatch by Yao et al., "Your Efficient RL Framework Secretly Brings You
    Off-Policy RL Training" (2025). level "sequence" uses the row's product of token ratios.
    Metric ``is_truncated_fraction``: tokens whose weight hit the cap.
    """
    old_logprobs_BT, sampler_logprobs_BT, mask_BT = x.old, x.need("sampler"), x.mask
    if cap < 1.0:
        raise ValueError(f"cap must be >= 1, got {cap}")
    mask_BT = mask_BT.bool()
    ratio_BT = torch.exp(log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT, level))
    weights_BT = torch.where(mask_BT, ratio_BT.clamp(max=cap), torch.zeros_like(ratio_BT))
    return weights_BT, {"is_truncated_fraction": masked_mean(ratio_BT > cap, mask_BT),
                        "is_weight_mean": masked_mean(weights_BT, mask_BT)}


def masked_is(
    x: LossInputs, *, low: float = 0.5, high: float = 2.0, level: str = "token",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Masked importance sampling: w = ρ inside [low, high], 0 outside (the token, or with level
    "sequence" the whole row, is dropped from the update).

    The masked counterpart of truncation (MIS, a baseline in the ALP work on off-policy
    corrections). Metric ``is_masked_fraction``: tokens given weight 0.
    """
    old_logprobs_BT, sampler_logprobs_BT, mask_BT = x.old, x.need("sampler"), x.mask
    if not 0.0 <= low <= 1.0 <= high:
        raise ValueError(f"need 0 <= low <= 1 <= high, got {low}, {high}")
    mask_BT = mask_BT.bool()
    ratio_BT = torch.exp(log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT, level))
    inside_BT = (ratio_BT >= low) & (ratio_BT <= high)
    weights_BT = torch.where(mask_BT & inside_BT, ratio_BT, torch.zeros_like(ratio_BT))
    return weights_BT, {"is_masked_fraction": masked_mean(~inside_BT, mask_BT),
                        "is_weight_mean": masked_mean(weights_BT, mask_BT)}


def geometric_mask(
    x: LossInputs, *, low: float = 0.999, high: float = 1.001,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Geometric-mean sequence mask: a row is trained (weight 1) only if the geometric mean of
    its token ratios, ρ_geo = exp(mean_t log(π_old / μ)), lies in [low, high]; else weight 0.

    Unlike the product of the ratios (``mis`` with level "sequence"), the geometric mean does not
    grow with the length, so one bound serves short and long rows. verl's "Geo-RS" rejection
    sampling (``rollout_rs = "seq_mean_k1"``; its presets use ±0.1%, the defaults here) and
    SkyRL's geometric sequence mask; motivated by Yao et al., "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training" (2025), and the Qwen team's arXiv:2512.01374.
    verl bounds exp(mean log(μ / π_old)), the reciprocal: its [a, b] is this [1/b, 1/a]
    (docs/algorithms.md). The kept rows are not reweighted. Metric ``is_masked_fraction``.
    """
    old_logprobs_BT, sampler_logprobs_BT, mask_BT = x.old, x.need("sampler"), x.mask
    if not 0.0 < low <= 1.0 <= high:
        raise ValueError(f"need 0 < low <= 1 <= high, got {low}, {high}")
    mask_BT = mask_BT.bool()
    lengths_B1 = mask_BT.sum(-1, keepdim=True).clamp(min=1)
    mean_log_ratio_B1 = log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT).sum(-1, keepdim=True) / lengths_B1
    inside_B1 = (mean_log_ratio_B1 >= math.log(low)) & (mean_log_ratio_B1 <= math.log(high))
    weights_BT = (mask_BT & inside_B1).to(old_logprobs_BT.dtype)
    return weights_BT, {"is_masked_fraction": masked_mean(~inside_B1.expand_as(mask_BT), mask_BT)}


def offpolicy_sequence_mask(x: LossInputs, *, delta: float) -> tuple[Tensor, dict[str, Tensor]]:
    """Off-policy sequence masking (OPSM): a row with a negative advantage whose tokens have
    drifted too far from the policy that sampled them is left out of the update.

    M_b = 0  if  mean_t A_b,t < 0  and  1/|y_b| Σ_t log(μ(y_t) / π_θ(y_t)) > delta,  else 1

    DeepSeek-AI, "DeepSeek-V3.2: Pushing the Frontier of Open Large Language Models",
    arXiv:2512.02556, Eq. 9 (μ: the sampling engine's probabilities; π_θ: the policy being
    trained, detached). Negative samples far off-policy are the ones whose gradient can push the
    policy anywhere; positive ones are kept. The decision is per row: the advantage's sign is its
    token mean, the drift its token mean (a row is kept or dropped whole). The paper gives no
    value for δ, so ``delta`` has no default: the logged ``mismatch_logratio_abs`` shows the drift
    on-policy; TRL's documentation uses 0.5 as an example. Checked against TRL's
    ``GRPOTrainer.get_off_policy_mask`` (tests/test_offpolicy_masks.py). Metric
    ``opsm_masked_fraction`` (rows dropped, among rows with tokens).
    """
    old_logprobs_BT, sampler_logprobs_BT, mask_BT = x.old, x.need("sampler"), x.mask
    advantages_BT, logprobs_BT = x.advantages, x.logprobs
    if delta < 0:
        raise ValueError(f"delta must be >= 0, got {delta}")
    mask_BT = mask_BT.bool()
    lengths_B = mask_BT.sum(-1)
    drift_B = log_ratio(sampler_logprobs_BT, logprobs_BT.detach(), mask_BT).sum(-1) / lengths_B.clamp(min=1)
    advantage_B = torch.where(mask_BT, advantages_BT, 0.0).sum(-1) / lengths_B.clamp(min=1)
    dropped_B = (advantage_B < 0) & (drift_B > delta)
    weights_BT = (mask_BT & ~dropped_B[:, None]).to(old_logprobs_BT.dtype)
    rows = (lengths_B > 0).sum().clamp(min=1)
    return weights_BT, {"opsm_masked_fraction": (dropped_B & (lengths_B > 0)).sum() / rows}


MISMATCH_BAND = (0.9, 1.1)
"""`mismatch_outside_band` counts the trained tokens whose learner/engine probability ratio lies
outside this band (the measure TRL's issue #6789 reported bf16 sampling by: 7.5% of tokens)."""


def mismatch_metrics(old_logprobs_BT: Tensor, sampler_logprobs_BT: Tensor, mask_BT: Tensor) -> dict[str, Tensor]:
    """How far the learner's log-probs are from the engine's: logged every step, corrected or not."""
    mask_BT = mask_BT.bool()
    log_ratio_BT = log_ratio(old_logprobs_BT, sampler_logprobs_BT, mask_BT)
    low, high = MISMATCH_BAND
    outside_BT = (log_ratio_BT < math.log(low)) | (log_ratio_BT > math.log(high))
    return {"mismatch_logratio_abs": masked_mean(log_ratio_BT.abs(), mask_BT),
            "mismatch_ratio_max": torch.where(mask_BT, log_ratio_BT.exp(), 0.0).max(),
            "mismatch_outside_band": masked_mean(outside_BT.to(log_ratio_BT.dtype), mask_BT)}


CORRECTIONS: dict[str, Callable[..., tuple[Tensor, dict[str, Tensor]]]] = {
    "none": no_correction,
    "tis": truncated_is,
    "mis": masked_is,
    "geo_mask": geometric_mask,
    "opsm": offpolicy_sequence_mask,
}

ROW_ADVANTAGE: frozenset[str] = frozenset({"opsm"})
"""Corrections that read one advantage per row (its token mean): a config refuses them with
per-token credit (a critic, a teacher, a PRM, turn credit), whose tokens' signs can differ."""
