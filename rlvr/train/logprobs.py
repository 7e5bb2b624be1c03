"""Log-probabilities of the trained tokens without materialising full-vocabulary logits for the batch.

A naive `model(ids).logits.log_softmax(-1)` holds [B, T, V] floats several times over (logits,
log-softmax, their gradients): on SmolLM2 (V = 49,152) at 16 × 256 tokens that is ~0.8 GB per
copy in fp32. Here the decoder's hidden states are taken at the positions whose next token is
trained, and the LM head and log-softmax run over chunks of those positions under activation
checkpointing, so at most one chunk of [chunk, V] logits exists at a time, forward or backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel


def _chunk_logprobs(
    hidden_NH: torch.Tensor, weight_VH: torch.Tensor, targets_N: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    logits_NV = (hidden_NH @ weight_VH.T).float() / temperature
    logz_N = logits_NV.logsumexp(-1)
    logprobs_N = logits_NV.gather(-1, targets_N[:, None]).squeeze(-1) - logz_N
    # entropy = logZ - Σ p·logit
    entropy_N = logz_N - (logits_NV.softmax(-1) * logits_NV).sum(-1)
    return logprobs_N, entropy_N


def token_logprobs(
    model: PreTrainedModel,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    target_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) of each token where target_mask_BT is set, 0 elsewhere.

    logprobs_BT[b, t] = log softmax(z_{b,t-1} / temperature)[input_ids[b, t]], where z is the
    LM-head output after token t-1, so position t scores token t. entropy_BT[b, t] is the
    entropy of that same distribution. target_mask_BT[:, 0] must be 0 (no token predicts it).
    Rows are right-padded; positions are 0..T-1 as in the engine's left-padded prompts.
    """
    if target_mask_BT[:, 0].any():
        raise ValueError("the first token of a row has no prediction; target_mask[:, 0] must be 0")
    hidden_BTH = model.base_model(input_ids=input_ids_BT, attention_mask=attention_mask_BT).last_hidden_state
    select_BT = target_mask_BT[:, 1:].bool()
    hidden_NH = hidden_BTH[:, :-1][select_BT]
    targets_N = input_ids_BT[:, 1:][select_BT]
    head = model.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("LM heads with a bias are not supported yet")
    pieces = [
        checkpoint(_chunk_logprobs, hidden_NH[i : i + chunk_size], head.weight, targets_N[i : i + chunk_size],
                   temperature, use_reentrant=False)
        for i in range(0, hidden_NH.shape[0], chunk_size)
    ]
    logprobs_N = torch.cat([p[0] for p in pieces]) if pieces else hidden_NH.new_zeros(0, dtype=torch.float32)
    entropy_N = torch.cat([p[1] for p in pieces]) if pieces else hidden_NH.new_zeros(0, dtype=torch.float32)
    shape = input_ids_BT.shape
    full_mask = torch.zeros(shape, dtype=torch.bool, device=input_ids_BT.device)
    full_mask[:, 1:] = select_BT
    logprobs_BT = torch.zeros(shape, dtype=torch.float32, device=input_ids_BT.device).masked_scatter(full_mask, logprobs_N)
    entropy_BT = torch.zeros(shape, dtype=torch.float32, device=input_ids_BT.device).masked_scatter(full_mask, entropy_N)
    return logprobs_BT, entropy_BT
