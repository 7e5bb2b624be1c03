"""Label-free rewards computed from the policy's own next-token distributions.

They need every token's full distribution, which the engine does not keep, so they are not
plain reward functions: after sampling, the loop runs the policy over the completions once (no
gradient) and these fill their reward parts (``rlvr.train.loop.score_intrinsic``). Name them in
the config like any reward: ``[[rewards]] fn = "self_certainty"``.

- ``self_certainty``: mean over the completion's tokens of KL(U ‖ p_t), the divergence of the
  next-token distribution from uniform: (1/V) Σ_v log(1/V / p_t(v)) = -log V - mean_v log p_t(v).
  Zhao et al., "Learning to Reason without External Rewards" (Intuitor, arXiv:2505.19590):
  confident (peaked) distributions score higher; unlike entropy it is mode-seeking and less
  prone to reward one confident wrong token.
- ``negative_entropy``: minus the mean token entropy, -mean_t H(p_t) (entropy minimisation as a
  reward: Agarwal et al., "The Unreasonable Effectiveness of Entropy Minimization in LLM
  Reasoning", arXiv:2505.15134).

Both are in nats per token. They pull the policy toward confidence regardless of correctness;
watch ``distinct_completion_fraction`` for collapse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.lora import causal_lm


@torch.no_grad()
def token_certainty(
    model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, target_mask_BT: torch.Tensor,
    *, temperature: float = 1.0, chunk_size: int = 256, media: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(self_certainty_B, negative_entropy_B): per-row means over the tokens where target_mask_BT is
    set, of KL(U ‖ p_t) and of -H(p_t), p_t the temperature-scaled distribution that predicted token t.
    ``media``: the rows' pixel inputs (a vision-language model)."""
    model = causal_lm(model)  # a LoRA policy: the wrapped model, adapters in its layers
    hidden_BTH = model.base_model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                                  **(media or {})).last_hidden_state
    select_BT = target_mask_BT[:, 1:].bool()
    hidden_NH = hidden_BTH[:, :-1][select_BT]
    weight_VH = model.get_output_embeddings().weight
    certainty, neg_entropy = [], []
    for i in range(0, hidden_NH.shape[0], chunk_size):
        logp_NV = torch.log_softmax((hidden_NH[i : i + chunk_size] @ weight_VH.T).float() / temperature, dim=-1)
        certainty.append(-logp_NV.mean(-1) - math.log(logp_NV.shape[-1]))
        neg_entropy.append((logp_NV.exp() * logp_NV).sum(-1))
    rows_N = torch.arange(select_BT.shape[0], device=select_BT.device)[:, None].expand_as(select_BT)[select_BT]
    counts_B = select_BT.sum(-1).clamp(min=1).float()
    out = []
    for values in (certainty, neg_entropy):
        v_N = torch.cat(values) if values else hidden_NH.new_zeros(0, dtype=torch.float32)
        out.append(torch.zeros(select_BT.shape[0]).index_add_(0, rows_N.cpu(), v_N.cpu()) / counts_B.cpu())
    return out[0], out[1]


def _self_certainty(certainty: float, negative_entropy: float) -> float:
    return certainty


def _negative_entropy(certainty: float, negative_entropy: float) -> float:
    return negative_entropy


INTRINSIC: dict[str, Callable[[float, float], float]] = {
    "self_certainty": _self_certainty,
    "negative_entropy": _negative_entropy,
}
"""Rewards filled in from the policy's distributions after sampling (see the module docstring)."""

INFORMATION_GAIN = "information_gain"


def information_gain(*_: Any) -> float:  # noqa: D401 - a marker: the loop computes this reward (score_groups)
    """Placeholder for the reward named "information_gain"; `score_groups` fills it in."""
    raise RuntimeError("information_gain is computed by the training loop (rlvr.train.methods.rlp.score_groups)")
