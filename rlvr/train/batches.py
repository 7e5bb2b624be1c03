"""Rows of samples as tensors: padding into micro-batches, and scoring them without gradient."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from rlvr.rewards.intrinsic import token_certainty
from rlvr.train.logprobs import token_budget_batches, token_logprobs
from rlvr.train.settings import UpdateSettings
from rlvr.types import Sample


def collate(samples: list[Sample], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows. ``completion_mask`` marks every completion token (where
    per-token values are placed); ``loss_mask`` the ones trained on: all of them except tokens an
    environment injected (``Completion.loss_mask`` 0)."""
    width = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    completion_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion.token_ids)
        ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion.token_ids)
        attention[i, : p + c] = 1
        completion_mask[i, p : p + c] = True
        own = s.completion.loss_mask
        loss_mask[i, p : p + c] = True if own is None else torch.tensor(own, dtype=torch.bool)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": completion_mask.to(device), "loss_mask": loss_mask.to(device)}


def micro_batches(indices: list[int], samples: list[Sample], size: int,
                   max_tokens: int | None = None) -> list[list[int]]:
    """At most ``size`` rows, and at most ``max_tokens`` padded tokens (rows × the longest row),
    per micro-batch; a row longer than that goes alone. Similar lengths go together: less
    padding. The totals passed to aggregate_loss keep the result independent of the cut.

    The token cap is what keeps memory bounded when rows are long (multi-turn episodes): the
    activations a backward pass keeps grow with the tokens in the micro-batch (about 1.1 MB a
    token on SmolLM2-135M in fp32, docs/LOG.md), so 16 rows of 1,000 tokens need some 18 GB."""
    ordered = sorted(indices, key=lambda i: samples[i].num_tokens)
    cuts = token_budget_batches([samples[i].num_tokens for i in ordered], max_tokens, size)
    return [[ordered[j] for j in cut] for cut in cuts]


def batches(samples: list[Sample], indices: list[int], pad_token_id: int, device: torch.device, size: int,
            max_tokens: int | None = None) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """The micro-batches of `indices` (see micro_batches), each with its collated tensors."""
    for micro in micro_batches(indices, samples, size, max_tokens):
        yield micro, collate([samples[i] for i in micro], pad_token_id, device)


def scored_batches(model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad_token_id: int,
                   device: torch.device, indices: list[int] | None = None,
                   ) -> Iterator[tuple[list[int], dict[str, torch.Tensor], torch.Tensor]]:
    """The micro-batches of `indices` (default: every sample) under the update's micro-batch
    settings, each with its collated tensors and `model`'s log-probs of the completion tokens at
    the sampling temperature (with gradients unless the caller turned them off)."""
    for micro, batch in batches(samples, list(range(len(samples))) if indices is None else indices, pad_token_id,
                                device, s.micro_batch_size, s.micro_batch_tokens):
        logprobs_BT, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                        temperature=s.temperature, chunk_size=s.logprob_chunk)
        yield micro, batch, logprobs_BT


@torch.no_grad()
def score_logprobs(
    model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """Per-sample log-probs of the completion tokens under `model` (old policy or reference);
    samples outside `which` are not scored (zeros: they are never trained on)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(model.parameters()).device
    for micro, batch, lp_BT in scored_batches(model, samples, s, pad, device, sorted(which)):
        for row, i in enumerate(micro):
            out[i] = lp_BT[row][batch["completion_mask"][row]]
    return out


@torch.no_grad()


def score_certainty(
    model: PreTrainedModel, samples: list[Sample], pad: int, *, temperature: float = 1.0, micro_batch_size: int = 8,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(self_certainty_N, negative_entropy_N): each sample's token means under `model`
    (rlvr.rewards.intrinsic.token_certainty), micro-batched like score_logprobs."""
    certainty, negative_entropy = torch.zeros(len(samples)), torch.zeros(len(samples))
    device = next(model.parameters()).device
    for micro, batch in batches(samples, list(range(len(samples))), pad, device, micro_batch_size):
        certainty[micro], negative_entropy[micro] = token_certainty(
            model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], temperature=temperature,
            chunk_size=chunk_size)
    return certainty, negative_entropy


def old_rows(old: Sequence[torch.Tensor | None], micro: list[int], current_BT: torch.Tensor,
              mask_BT: torch.Tensor) -> torch.Tensor:
    """The old policy's log-probs of a micro-batch; a sample without stored ones (None) takes the
    current policy's, detached (its first optimizer step on a fresh rollout)."""
    rows = {i: old[i] if old[i] is not None else current_BT[r][mask_BT[r]] for r, i in enumerate(micro)}
    return token_rows(rows, micro, mask_BT)  # type: ignore[arg-type]


def token_rows(per_sample: list[torch.Tensor], micro: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-sample completion values into the micro-batch's [B, T] layout."""
    values = torch.cat([per_sample[i] for i in micro])
    out = torch.zeros(mask_BT.shape, dtype=torch.promote_types(values.dtype, torch.float32), device=mask_BT.device)
    return out.masked_scatter(mask_BT, values.to(out.dtype))
