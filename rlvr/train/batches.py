"""Rows of samples as tensors: padding into micro-batches, and scoring them without gradient."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from transformers import PreTrainedModel

from rlvr.data.images import batched_inputs, uses_multimodal_positions
from rlvr.rewards.intrinsic import token_certainty
from rlvr.models import product_width, windowed_attention
from rlvr.train.logprobs import (can_share_prompts, completion_layout, packs_completions, shared_prompt_logprobs,
                                 token_budget_batches, token_logprobs)
from rlvr.train.parallel import sharded
from rlvr.train.settings import UpdateSettings
from rlvr.types import PromptMedia, Sample


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


SHARED_TOKEN_COST = 1.4
"""What a token costs the learner in a micro-batch whose prompts are shared, relative to a token of
a whole row: a completion runs on its prompt's cache under an explicit attention mask (not the
causal kernel), and the cache is selected per row. Measured per token run: 1.53× (16 × (64 +
192), fp32, Intel Xeon 6/207), 1.31× (the same in bf16, Zen 4 EPYC), 1.47× (448 + 64, Zen 4),
1.37× (the demo's shapes, Zen 4); docs/LOG.md. Sharing is used where it still comes out cheaper:
short prompts with long completions run whole."""


def trained_through(x: Sample) -> int:
    """The completion tokens the learner runs for `x`: through its last trained token (``loss_mask``),
    since neither path runs the columns after it (an episode's closing observation, say)."""
    mask = x.completion.loss_mask
    return len(x.completion.token_ids) if mask is None else max((i + 1 for i, m in enumerate(mask) if m), default=0)


def run_cost(rows: list[Sample], share: bool = True, lanes: bool = True) -> float:
    """One micro-batch's learner cost in whole-row tokens: its rows padded to the longest run
    (each through its last trained token), or, with ``share`` where prompts repeat and it is
    cheaper, its `shared_tokens` at SHARED_TOKEN_COST (``lanes``: as `shared_tokens`)."""
    whole = len(rows) * max(len(x.prompt_ids) + trained_through(x) for x in rows)
    if not share or len({x.prompt_key for x in rows}) == len(rows):
        return whole
    return min(whole, SHARED_TOKEN_COST * shared_tokens(rows, lanes))


def prompt_sharing(model: PreTrainedModel, s: UpdateSettings) -> bool:
    """Whether the learner may encode a prompt shared by several rows once (`sample_logprobs`,
    in the micro-batches where that is cheaper): ``s.passes.share_prompts``, and a model whose
    attention spans every column (a window counts a shared prompt's padding as tokens, and the
    packed completions' mask would replace it: rlvr.models.windowed_attention) and that keeps a
    key/value cache (not under activation checkpointing). The micro-batch cut and the pass
    agree on it."""
    # sharded learners run one forward per micro-batch on every rank (rlvr.train.parallel.idle_passes)
    return (s.passes.share_prompts and windowed_attention(model) is None and can_share_prompts(model)
            and not sharded(model))


def shares_prompts(rows: list[Sample], lanes: bool = True) -> bool:
    """Whether a micro-batch runs its prompts shared (when allowed): prompts repeat and that is
    cheaper (``lanes``: as `shared_tokens`)."""
    return run_cost(rows, lanes=lanes) < run_cost(rows, share=False)


def micro_batches(indices: list[int], samples: list[Sample], size: int,
                   max_tokens: int | None = None, by_prompt: bool = False, lanes: bool = True) -> list[list[int]]:
    """At most ``size`` rows, and at most ``max_tokens`` padded tokens (rows × the longest row),
    per micro-batch; a row longer than that goes alone. Similar lengths go together: less
    padding. With ``by_prompt`` (the micro-batches will encode each distinct prompt once:
    `sample_logprobs`), two orders are cut and the one with fewer tokens to run is kept: rows of
    a prompt together (one prompt pass per group; their completions padded to the group's
    longest), or by completion length (little padding, prompts shared only where rows of one
    land together), each micro-batch costed by `run_cost`. The totals passed to aggregate_loss
    keep the result independent of the cut. ``lanes``: whether the learner packs a prompt's
    completions into shared rows (rlvr.train.logprobs.packs_completions), as `shared_tokens` counts.

    The token cap is what keeps memory bounded when rows are long (multi-turn episodes): the
    activations a backward pass keeps grow with the tokens in the micro-batch (about 1.1 MB a
    token on SmolLM2-135M in fp32, docs/LOG.md), so 16 rows of 1,000 tokens need some 18 GB."""
    def cut(ordered: list[int]) -> list[list[int]]:
        cuts = token_budget_batches([samples[i].num_tokens for i in ordered], max_tokens, size)
        return [[ordered[j] for j in c] for c in cuts]

    if not by_prompt:
        return cut(sorted(indices, key=lambda i: samples[i].num_tokens))
    together = cut(sorted(indices, key=lambda i: (len(samples[i].prompt_ids), samples[i].prompt_ids,
                                                  samples[i].prompt_index, len(samples[i].completion.token_ids))))
    by_length = cut(sorted(indices, key=lambda i: (len(samples[i].completion.token_ids), samples[i].prompt_ids)))
    return min(together, by_length, key=lambda cuts: sum(run_cost([samples[i] for i in c], lanes=lanes) for c in cuts))


def shared_tokens(rows: list[Sample], lanes: bool = True) -> int:
    """The tokens `sample_logprobs` runs for one micro-batch with its prompts shared: each
    distinct prompt once (padded to the longest), and each completion through its last trained
    token but for that token, padded to the longest; with ``lanes``, packed into rows as long as
    the longest where that gives fewer rows, else one row each
    (rlvr.train.logprobs.completion_layout). Either pass is padded wider where it would run
    fewer than `FEWEST_ROWS` tokens (rlvr.models.product_width)."""
    prompts = {x.prompt_key: len(x.prompt_ids) for x in rows}
    index = {key: i for i, key in enumerate(prompts)}
    fed = [max(trained_through(x) - 1, 0) for x in rows]
    packed, width = completion_layout(fed, [index[x.prompt_key] for x in rows], lanes)
    return len(prompts) * product_width(len(prompts), max(prompts.values())) + len(packed or rows) * width


def batches(samples: list[Sample], indices: list[int], pad_token_id: int, device: torch.device, size: int,
            max_tokens: int | None = None, by_prompt: bool = False, lanes: bool = True,
            ) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """The micro-batches of `indices` (see micro_batches), each with its collated tensors."""
    for micro in micro_batches(indices, samples, size, max_tokens, by_prompt, lanes):
        yield micro, collate([samples[i] for i in micro], pad_token_id, device)


def sample_logprobs(model: PreTrainedModel, rows: list[Sample], batch: dict[str, torch.Tensor], s: UpdateSettings,
                    pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) of a micro-batch's trained tokens (``loss_mask``) at the sampling
    temperature, in `collate`'s layout (`batch`), 0 elsewhere. Rows that share a prompt have it
    encoded once (rlvr.train.logprobs.shared_prompt_logprobs) when ``s.passes.share_prompts``, the model
    allows it and it is cheaper (`shares_prompts`); otherwise each row runs whole
    (token_logprobs). Both give the same values to float rounding.

    Tokens an environment injected are run (the trained tokens after them attend to them) but not
    scored: every loss, metric and divergence reads the trained tokens only, and a multi-turn
    episode is mostly observations (guess_number: 88 injected tokens to 46 sampled). Columns after
    the last trained token are not run at all."""
    prompts: dict[tuple[tuple[int, ...], PromptMedia | None], int] = {}
    row_prompt = [prompts.setdefault(x.prompt_key, len(prompts)) for x in rows]
    device, dtype = batch["input_ids"].device, next(model.parameters()).dtype
    trained_BT = batch["loss_mask"]
    # a prompt's cache serves its completions only where positions are a plain count and no input runs per token
    plain = not any(x.media is not None and (x.media.tokens or uses_multimodal_positions(model)) for x in rows)
    if not (plain and prompt_sharing(model, s) and shares_prompts(rows, packs_completions(model))):
        return _whole_rows(model, rows, batch, s, dtype)
    logprobs_N, entropy_N = shared_prompt_logprobs(
        model, [list(ids) for ids, _ in prompts], [list(x.completion.token_ids) for x in rows], row_prompt,
        pad_token_id, temperature=s.passes.temperature, chunk_size=s.passes.logprob_chunk,
        media=batched_inputs([m for _, m in prompts], device, dtype),
        scored=[x.completion.loss_mask or (1,) * len(x.completion.token_ids) for x in rows])
    zeros = torch.zeros(trained_BT.shape, dtype=logprobs_N.dtype, device=trained_BT.device)
    return zeros.masked_scatter(trained_BT, logprobs_N), zeros.masked_scatter(trained_BT, entropy_N)


def _whole_rows(model: PreTrainedModel, rows: list[Sample], batch: dict[str, torch.Tensor], s: UpdateSettings,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_logprobs` with every row run whole (token_logprobs), up to the last trained column
    (and at least over every prompt: an image's tokens are not cut from its pixels)."""
    trained_BT = batch["loss_mask"]
    columns = trained_BT.any(0).nonzero()
    width = max(int(columns[-1]) + 1 if len(columns) else 1, max(len(x.prompt_ids) for x in rows))
    cut = {key: batch[key][:, :width] for key in ("input_ids", "attention_mask")}
    logprobs_BW, entropy_BW = token_logprobs(
        model, cut["input_ids"], cut["attention_mask"], trained_BT[:, :width], temperature=s.passes.temperature,
        chunk_size=s.passes.logprob_chunk, media=row_inputs([x.media for x in rows], cut, dtype))
    if width == trained_BT.shape[1]:
        return logprobs_BW, entropy_BW
    pad = (0, trained_BT.shape[1] - width)
    return torch.nn.functional.pad(logprobs_BW, pad), torch.nn.functional.pad(entropy_BW, pad)


def row_inputs(media: list[PromptMedia | None], batch: dict[str, torch.Tensor], dtype: torch.dtype,
               ) -> dict[str, torch.Tensor]:
    """The image inputs of `collate`'s right-padded rows (rlvr.data.images.batched_inputs): every
    prompt starts at column 0. A model with 3-D image positions computes them from these."""
    ids = batch["input_ids"]
    return batched_inputs(media, ids.device, dtype, starts=[0] * len(media), width=ids.shape[1])


def scored_batches(model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad_token_id: int,
                   device: torch.device, indices: list[int] | None = None,
                   ) -> Iterator[tuple[list[int], dict[str, torch.Tensor], torch.Tensor]]:
    """The micro-batches of `indices` (default: every sample) under the update's micro-batch
    settings, each with its collated tensors and `model`'s log-probs of the completion tokens at
    the sampling temperature (with gradients unless the caller turned them off)."""
    for micro, batch in batches(samples, list(range(len(samples))) if indices is None else indices, pad_token_id,
                                device, s.passes.micro_batch_size, s.passes.micro_batch_tokens,
                                prompt_sharing(model, s),
                                packs_completions(model)):
        logprobs_BT, _ = sample_logprobs(model, [samples[i] for i in micro], batch, s, pad_token_id)
        yield micro, batch, logprobs_BT


@torch.no_grad()
def score_logprobs(
    model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """Per-sample log-probs of the completion tokens under `model` (old policy or reference), 0
    at tokens an environment injected (`sample_logprobs`); samples outside `which` are not
    scored (zeros: they are never trained on)."""
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
            chunk_size=chunk_size, media=row_inputs([samples[i].media for i in micro], batch,
                                                    next(model.parameters()).dtype))
    return certainty, negative_entropy


def old_rows(old: Sequence[torch.Tensor | None], micro: list[int], current_BT: torch.Tensor,
              mask_BT: torch.Tensor) -> torch.Tensor:
    """The old policy's log-probs of a micro-batch; a sample without stored ones (None) takes the
    current policy's, detached (its first optimizer step on a fresh rollout)."""
    rows = {i: old[i] if old[i] is not None else current_BT[r][mask_BT[r]] for r, i in enumerate(micro)}
    return token_rows(rows, micro, mask_BT)  # type: ignore[arg-type]


def token_rows(per_sample: list[torch.Tensor], micro: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-sample completion values into the micro-batch's [B, T] layout, on the mask's
    device. Per-sample values are kept on the CPU, but a row's old log-probs can come from a
    scoring pass on the model's device beside a replayed row's stored ones: each goes where the
    micro-batch runs before they are joined."""
    values = torch.cat([per_sample[i].to(mask_BT.device) for i in micro])
    out = torch.zeros(mask_BT.shape, dtype=torch.promote_types(values.dtype, torch.float32), device=mask_BT.device)
    return out.masked_scatter(mask_BT, values.to(out.dtype))
