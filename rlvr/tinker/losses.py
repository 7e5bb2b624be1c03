"""Tinker's built-in losses, each on rlvr's own implementation (rlvr.algos.losses).

Tinker defines every loss per token, summed over tokens and datums (never a mean), on
``target_logprobs`` (the learner's log-probs of ``target_tokens``, the only quantity with a
gradient) and the datum's ``loss_fn_inputs``; its docs give a PyTorch snippet for each
(https://tinker-docs.thinkingmachines.ai/tinker/losses/). Here:

========================  ===========================================================================
cross_entropy             `pg_loss` with the weights as advantages: -Σ w · lp. Targets may be [N, K]
                          (top-K distillation), scored K per position.
importance_sampling       `ppo_clip_loss` with nothing clipped (clip_low 1, clip_high inf): -Σ r · A
ppo                       `ppo_clip_loss`; Tinker's thresholds are absolute ratio bounds (default 0.8,
                          1.2), rlvr's are distances from 1.
cispo                     `cispo_loss` (default bounds 0, 4): -Σ sg(clip(r)) · lp · A
dro                       `opmd_loss` with τ = beta: -Σ (A · lp - β/2 · (lp - logprobs)²); beta from
                          loss_fn_config, default 0.05 (Tinker's documented example)
gspo                      GSPO-token (Zheng et al., arXiv:2507.18071, section 4.3): `ppo_clip_loss` on
                          each token's ratio sg(s) · p/sg(p), s the geometric mean ratio over the
                          tokens ``sequence_ratio_mask`` marks; bounds 0.8, 1.2 (rlvr's choice: Tinker
                          does not publish its defaults).
stable_reinforce          refused: its objective is not public (an alpha of Tinker's service).
========================  ===========================================================================

r = exp(lp - logprobs), ``logprobs`` being the sampler's. Every loss reports ``loss:sum`` (the
client's ``metrics["loss:sum"]``) and its rlvr metrics as ``name:mean``; every datum's output is
its ``logprobs``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from rlvr.algos.aggregation import aggregate_loss
from rlvr.algos.inputs import LossInputs
from rlvr.algos.losses import cispo_loss, opmd_loss, pg_loss, ppo_clip_loss
from rlvr.tinker.wire import Datum

NEEDS: dict[str, tuple[str, ...]] = {
    "cross_entropy": ("target_tokens",),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
    "cispo": ("target_tokens", "logprobs", "advantages"),
    "dro": ("target_tokens", "logprobs", "advantages"),
    "gspo": ("target_tokens", "logprobs", "advantages"),
}
CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {},
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
    "dro": {"beta": 0.05},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
}
"""Each loss's ``loss_fn_config`` keys and their defaults."""

KNOWN_INPUTS = {"target_tokens", "weights", "logprobs", "advantages", "sequence_ratio_mask"}


class LossError(ValueError):
    """A request the loss cannot take (a user error: the future fails with category "user")."""


def check_inputs(loss_fn: str, data: list[Datum], tokenizer: Any, vocab: int, context: int) -> None:
    """Refuse what the loss cannot compute, saying which datum and input, before any work."""
    if loss_fn == "stable_reinforce":
        raise LossError("loss_fn 'stable_reinforce' is not available in rlvr tinker: its objective (and its "
                        "stability information) is not public, so it cannot be reproduced faithfully; use "
                        "'importance_sampling', 'ppo', 'cispo', 'gspo' or 'dro' (with the tinker cookbook: "
                        "loss_fn=importance_sampling)")
    if loss_fn == "custom":
        raise LossError("server-side custom losses (loss_fn 'custom', a traced LossHandle) are not run here; "
                        "forward_backward_custom with a Python function runs the loss in the client and works")
    if loss_fn not in NEEDS:
        raise LossError(f"unknown loss_fn {loss_fn!r}; rlvr tinker has {', '.join(NEEDS)}")
    for i, d in enumerate(data):
        n = len(d.tokens)
        if n == 0:
            raise LossError(f"data[{i}].model_input is empty")
        if n > context:
            raise LossError(f"data[{i}] has {n} tokens, over the model's context of {context}")
        if any(not 0 <= t < vocab for t in d.tokens):
            raise LossError(f"data[{i}].model_input holds token ids outside the vocabulary (0..{vocab - 1})")
        for name in NEEDS[loss_fn]:
            if name not in d.inputs:
                raise LossError(f"data[{i}].loss_fn_inputs has no {name!r}, which loss_fn {loss_fn!r} needs "
                                f"({', '.join(NEEDS[loss_fn])})")
        unknown = set(d.inputs) - KNOWN_INPUTS
        if unknown & {"clip_low_threshold", "clip_high_threshold"}:
            raise LossError(f"data[{i}].loss_fn_inputs: per-token clip thresholds are not supported (their meaning is "
                            "not documented); set clip_low_threshold / clip_high_threshold in loss_fn_config")
        targets = d.inputs["target_tokens"]
        wide = loss_fn == "cross_entropy" and targets.ndim == 2
        if targets.shape[0] != n or (targets.ndim != 1 and not wide):
            raise LossError(f"data[{i}].loss_fn_inputs['target_tokens'] has shape {list(targets.shape)}; it must be "
                            f"[{n}] (one target per input token){', or [N, K] for cross_entropy' if loss_fn == 'cross_entropy' else ''}")
        if targets.dtype.kind not in "iu" or np.any((targets < 0) | (targets >= vocab)):
            raise LossError(f"data[{i}].loss_fn_inputs['target_tokens'] must be token ids in 0..{vocab - 1}")
        for name, value in d.inputs.items():
            if name == "target_tokens" or name not in KNOWN_INPUTS:
                continue
            if list(value.shape) != list(targets.shape):
                raise LossError(f"data[{i}].loss_fn_inputs[{name!r}] has shape {list(value.shape)}, target_tokens "
                                f"{list(targets.shape)}: they must match")
            if not np.all(np.isfinite(value)):
                raise LossError(f"data[{i}].loss_fn_inputs[{name!r}] holds a value that is not finite")
        if loss_fn == "gspo" and "sequence_ratio_mask" in d.inputs and not np.any(d.inputs["sequence_ratio_mask"]):
            raise LossError(f"data[{i}].loss_fn_inputs['sequence_ratio_mask'] marks no token: GSPO's sequence ratio "
                            "is a mean over the marked tokens")


def _config(loss_fn: str, config: dict[str, float | str]) -> dict[str, float]:
    known = CONFIG[loss_fn]
    unknown = sorted(set(config) - set(known))
    if unknown:
        raise LossError(f"loss_fn_config for {loss_fn!r}: unknown key(s) {unknown}; it takes "
                        f"{sorted(known) or 'none'}")
    out = dict(known)
    for k, v in config.items():
        if isinstance(v, str) or not math.isfinite(v):
            raise LossError(f"loss_fn_config[{k!r}] must be a finite number, got {v!r}")
        out[k] = float(v)
    return out


def _padded(rows: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=fill)


def _input(data: list[Datum], name: str, like: list[torch.Tensor], default: float | None = None) -> torch.Tensor:
    rows = []
    for d, lp in zip(data, like):
        if name in d.inputs:
            rows.append(torch.as_tensor(d.inputs[name].reshape(-1), dtype=lp.dtype, device=lp.device))
        else:
            assert default is not None
            rows.append(torch.full_like(lp, default))
    return _padded(rows)


def tinker_loss(loss_fn: str, logprobs: list[torch.Tensor], data: list[Datum], config: dict[str, float | str],
                ) -> tuple[torch.Tensor, dict[str, float], list[dict[str, np.ndarray]]]:
    """(the loss to back-propagate: Tinker's sum, its metrics, each datum's outputs). ``logprobs``:
    each datum's target log-probs, flattened ([N] or [N·K]), with gradient where it is wanted."""
    knobs = _config(loss_fn, config)
    flat = [lp.reshape(-1) for lp in logprobs]
    lp_BT = _padded(flat)
    mask_BT = _padded([torch.ones_like(lp, dtype=torch.bool) for lp in flat])
    if loss_fn == "cross_entropy":
        weights_BT = _input(data, "weights", flat, default=0.0)  # no weights: a forward that trains nothing
        x = LossInputs(logprobs=lp_BT, old=lp_BT.detach(), advantages=weights_BT, mask=mask_BT)
        loss_BT, metrics = pg_loss(x)
        metrics = {}  # pg's ratio is 1 by construction here
    else:
        sampler_BT = _input(data, "logprobs", flat)
        advantages_BT = _input(data, "advantages", flat)
        old_BT = sampler_BT
        if loss_fn == "gspo":
            # every token's ratio takes the sequence ratio's value, with its own log-prob's gradient
            ratio_mask_BT = _input(data, "sequence_ratio_mask", flat, default=1.0) != 0
            log_s_B = (torch.where(ratio_mask_BT, lp_BT.detach() - sampler_BT, 0.0).sum(-1)
                       / ratio_mask_BT.sum(-1).clamp(min=1))
            old_BT = lp_BT.detach() - log_s_B[:, None]
        x = LossInputs(logprobs=lp_BT, old=old_BT, advantages=advantages_BT, mask=mask_BT)
        low, high = knobs.get("clip_low_threshold"), knobs.get("clip_high_threshold")
        try:
            if loss_fn == "importance_sampling":
                loss_BT, metrics = ppo_clip_loss(x, clip_low=1.0, clip_high=math.inf)
                metrics = {"ratio_mean": metrics["ratio_mean"]}
            elif loss_fn in ("ppo", "gspo"):
                assert low is not None and high is not None
                loss_BT, metrics = ppo_clip_loss(x, clip_low=1.0 - low, clip_high=high - 1.0)
            elif loss_fn == "cispo":
                loss_BT, metrics = cispo_loss(x, min_weight=low, max_weight=high)  # type: ignore[arg-type]
            else:
                loss_BT, metrics = opmd_loss(x, tau=knobs["beta"])  # DRO's objective, β = τ
        except ValueError as e:
            raise LossError(f"loss_fn_config for {loss_fn!r}: {e} (Tinker's thresholds are ratio bounds: "
                            "clip_low_threshold <= 1 <= clip_high_threshold)") from None
    # Tinker's sum over tokens and datums: verl's seq-mean-token-sum over "one sequence"
    loss = aggregate_loss(loss_BT, mask_BT, mode="seq-mean-token-sum", total_seqs=1)
    out_metrics = {"loss:sum": float(loss.detach())}
    out_metrics |= {f"{k}:mean": float(v) for k, v in metrics.items() if not k.endswith("_max")}
    out_metrics |= {f"{k}:max": float(v) for k, v in metrics.items() if k.endswith("_max")}
    outputs = [{"logprobs": lp.detach().float().cpu().numpy().reshape(d.inputs["target_tokens"].shape)}
               for lp, d in zip(logprobs, data)]
    return loss, out_metrics, outputs
