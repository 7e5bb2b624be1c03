"""Log-probabilities of the trained tokens without materialising full-vocabulary logits for the batch.

A naive `model(ids).logits.log_softmax(-1)` holds [B, T, V] floats several times over (logits,
log-softmax, their gradients): on SmolLM2 (V = 49,152) at 16 × 256 tokens that is ~0.8 GB per
copy in fp32. Here the decoder's hidden states are taken at the positions whose next token is
trained, and the LM head and log-softmax run over chunks of those positions with a hand-written
backward that recomputes the chunk's logits, so at most one chunk of [chunk, V] logits (and one
of probabilities) exists at a time, forward or backward.
"""

from __future__ import annotations

import functools

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.attention import is_sdpa
from rlvr.data.chat import Tokenized
from rlvr.lora import causal_lm
from rlvr.models import padded_rows, product_width, with_cache


class _HeadLogprobs(torch.autograd.Function):
    """Log-probability of each target token and the entropy of each row of softmax(h Wᵀ / τ),
    for one chunk of positions, with a hand-written backward.

    Autograd through `logsumexp`, `gather` and an entropy term keeps several [N, V] tensors
    alive and makes as many passes over them (the gather's backward alone fills an [N, V] zero
    tensor); on SmolLM2's 49,152-token vocabulary those memory-bound passes took about a quarter
    of a learner step (docs/LOG.md). Here the forward saves only h, the targets and two numbers
    per row (log Z and E_p[z]); the backward recomputes the logits once and forms the gradient
    in place:

        d logp_n / d z_n = onehot(target_n) - p_n
        d H_n    / d z_n = -p_n ⊙ (z_n - E_p[z_n])

    with z = h Wᵀ / τ, p = softmax(z), H = log Z - E_p[z]. Gradients reach h and W (through
    the 1/τ scaling).
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, hidden_NH: torch.Tensor, weight_VH: torch.Tensor,
        targets_N: torch.Tensor, temperature: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        z_NV = _at_least_fp32(hidden_NH @ weight_VH.T)
        if temperature != 1.0:
            z_NV /= temperature
        logz_N = torch.logsumexp(z_NV, dim=-1)
        logprobs_N = z_NV.gather(-1, targets_N[:, None]).squeeze(-1) - logz_N
        p_NV = torch.exp(z_NV - logz_N[:, None])
        mean_z_N = (p_NV * z_NV).sum(-1)  # E_p[z]
        entropy_N = logz_N - mean_z_N
        ctx.save_for_backward(hidden_NH, weight_VH, targets_N, logz_N, mean_z_N)
        ctx.temperature = temperature  # type: ignore[attr-defined]
        return logprobs_N, entropy_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs_N: torch.Tensor | None,
        grad_entropy_N: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        hidden_NH, weight_VH, targets_N, logz_N, mean_z_N = ctx.saved_tensors  # type: ignore[attr-defined]
        temperature: float = ctx.temperature  # type: ignore[attr-defined]
        z_NV = _at_least_fp32(hidden_NH @ weight_VH.T)
        if temperature != 1.0:
            z_NV /= temperature
        grad_NV = torch.exp(z_NV - logz_N[:, None])  # p
        if grad_entropy_N is not None and bool(grad_entropy_N.any()):
            # -g_H · p ⊙ (z - E[z]), computed into z's buffer
            z_NV.sub_(mean_z_N[:, None]).mul_(grad_NV).mul_(-grad_entropy_N[:, None])
        else:
            z_NV = None  # type: ignore[assignment]
        if grad_logprobs_N is not None:
            grad_NV.mul_(-grad_logprobs_N[:, None])  # -g · p
            grad_NV.scatter_add_(-1, targets_N[:, None], grad_logprobs_N[:, None])  # + g · onehot
        else:
            grad_NV.zero_()
        if z_NV is not None:
            grad_NV += z_NV
        if temperature != 1.0:
            grad_NV /= temperature
        grad_NV = grad_NV.to(hidden_NH.dtype)
        grad_hidden = grad_NV @ weight_VH if ctx.needs_input_grad[0] else None  # type: ignore[attr-defined]
        grad_weight = grad_NV.T @ hidden_NH if ctx.needs_input_grad[1] else None  # type: ignore[attr-defined]
        return grad_hidden, grad_weight, None, None


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """bf16 logits are taken to fp32 for the softmax; a float64 model (the tests' exact reference) stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def token_logprobs(
    model: PreTrainedModel,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    target_mask_BT: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    position_ids_BT: torch.Tensor | None = None,
    media: Mapping[str, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_BT, entropy_BT) of each token where target_mask_BT is set, 0 elsewhere.

    logprobs_BT[b, t] = log softmax(z_{b,t-1} / temperature)[input_ids[b, t]], where z is the
    LM-head output after token t-1, so position t scores token t. entropy_BT[b, t] is the
    entropy of that same distribution. target_mask_BT[:, 0] must be 0 (no token predicts it).
    Rows are right-padded; positions are 0..T-1 as in the engine's left-padded prompts.
    Packed rows (several sequences per row, rlvr.train.offline) pass their own position_ids_BT
    and a [B, 1, T, T] boolean attention mask that keeps each sequence to itself.
    ``media``: the rows' pixel inputs (rlvr.data.images.batched_inputs), for a vision-language
    model whose ids hold image tokens.
    """
    if target_mask_BT[:, 0].any():
        raise ValueError("the first token of a row has no prediction; target_mask[:, 0] must be 0")
    rows, width = input_ids_BT.shape
    wide = product_width(rows, width)
    if wide > width and attention_mask_BT.dim() == 2 and position_ids_BT is None and not media:
        # fewer than FEWEST_ROWS tokens: masked pad columns on the right, so the products run
        # enough rows to round as in any larger batch (rlvr.models.product_width). Not with media,
        # whose per-token inputs are as wide as the ids (an image alone is 4 tokens or more)
        def wider(t: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.pad(t, (0, wide - width))

        logprobs_BT, entropy_BT = token_logprobs(model, wider(input_ids_BT), wider(attention_mask_BT),
                                                 wider(target_mask_BT), temperature=temperature,
                                                 chunk_size=chunk_size)
        return logprobs_BT[:, :width], entropy_BT[:, :width]
    model = causal_lm(model)  # a LoRA policy: the wrapped model, adapters in its layers
    select_BT = target_mask_BT[:, 1:].bool()
    targets_N = input_ids_BT[:, 1:][select_BT]
    # sharded learners: the same function as a method of the model, which gathers its weights first
    scored = getattr(model, SCORED, None) or functools.partial(scored_tokens, model)
    logprobs_N, entropy_N = scored(input_ids_BT, attention_mask_BT, position_ids_BT, media, select_BT, targets_N,
                                   temperature, chunk_size)
    dtype = logprobs_N.dtype
    shape = input_ids_BT.shape
    full_mask = torch.zeros(shape, dtype=torch.bool, device=input_ids_BT.device)
    full_mask[:, 1:] = select_BT
    logprobs_BT = torch.zeros(shape, dtype=dtype, device=input_ids_BT.device).masked_scatter(full_mask, logprobs_N)
    entropy_BT = torch.zeros(shape, dtype=dtype, device=input_ids_BT.device).masked_scatter(full_mask, entropy_N)
    return logprobs_BT, entropy_BT


SCORED = "rlvr_scored_tokens"
"""The name `scored_tokens` has as a method of a sharded model (rlvr.scaleout.sharded registers it
with FSDP2, which then gathers the weights outside the decoder layers before it runs)."""


def scored_tokens(model: PreTrainedModel, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor,
                  position_ids_BT: torch.Tensor | None, media: Mapping[str, torch.Tensor] | None,
                  select_BT: torch.Tensor, targets_N: torch.Tensor, temperature: float, chunk_size: int,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`token_logprobs`' forward pass: the selected positions' (logprobs_N, entropy_N), the head
    applied to the hidden states in chunks (`_head_logprobs`)."""
    hidden_BTH = model.base_model(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                                  position_ids=position_ids_BT, **(media or {})).last_hidden_state
    return _head_logprobs(model, hidden_BTH[:, :-1][select_BT], targets_N, temperature, chunk_size)


def can_share_prompts(model: Any) -> bool:
    """Whether `shared_prompt_logprobs` can run on `model`: it needs the key/value cache, which
    Hugging Face turns off under activation checkpointing in training mode."""
    lm = causal_lm(model)
    name = "is_activation_checkpointing" if hasattr(type(lm), "is_activation_checkpointing") else \
        "is_gradient_checkpointing"  # renamed in transformers 5
    return not (lm.training and getattr(lm, name, False))


def packs_completions(model: Any) -> bool:
    """Whether `shared_prompt_logprobs` runs a prompt's completions packed into shared rows
    (`completion_lanes`): where the model's attention takes a custom boolean mask as it is
    (SDPA, or rlvr.attention's float32 SDPA; eager attention adds a mask of floats, and
    FlashAttention-2 takes none), in a model class of transformers' own (remote code may build
    its masks its own way and not take a 4D mask as given). `model` is the model as trained (a
    PEFT wrapper included), not `causal_lm`'s inner model."""
    lm = causal_lm(model)
    return type(lm).__module__.startswith("transformers.") and is_sdpa(lm)


def shared_prompt_logprobs(
    model: PreTrainedModel,
    prompts: list[list[int]],
    completions: list[list[int]],
    row_prompt: list[int],
    pad_token_id: int,
    *,
    temperature: float = 1.0,
    chunk_size: int = 256,
    media: Mapping[str, torch.Tensor] | None = None,
    scored: Sequence[Sequence[int]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N, entropy_N) of every completion token, rows in order, each prompt encoded once;
    with ``scored`` (a 0/1 flag per completion token of each row), of the flagged tokens only.

    Row b is ``prompts[row_prompt[b]] + completions[b]``. The G samples of a GRPO group share
    their prompt, and the per-row computation (token_logprobs) runs that prompt through the
    model G times, forward and backward. Here the distinct prompts run once, keeping their keys
    and values with gradient; each row's completion then runs on a copy of its prompt's cache
    (a differentiable index of it), so its tokens attend to the prompt exactly as in the whole
    row, and the backward sums every row's gradient into the one prompt pass. The log-probs, and
    so every loss and its gradient, are the per-row ones up to float rounding (summation order);
    tests/test_shared_prompts.py holds the two equal. This is the shared-prefix idea of
    "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward" (arXiv:2506.05433),
    which concatenates a group into one sequence under a grouped attention mask; going through
    the key/value cache instead keeps each completion's attention to its own prompt and tokens
    (no attention over the other completions to mask out) and any Hugging Face causal LM whose
    cache is a `DynamicCache` works unchanged.

    The first completion token is scored from the prompt pass's last hidden state, the others
    from the completion pass; the last completion token is never fed (it predicts nothing).
    Prompts are right-padded (pads attend to the real tokens before them, so no row of the
    attention is empty) and masked out of every completion's attention. ``media``: the prompts'
    pixel inputs, in prompt order (a vision-language model), taken by the prompt pass.

    ``scored`` leaves out what no flagged token needs: the LM head and softmax at unflagged
    tokens (a multi-turn episode's injected observations, most of its tokens), and a row's
    tokens after its last flagged one. Earlier unflagged tokens are still run: flagged tokens
    after them attend to them.
    """
    from transformers import DynamicCache

    flags = [[1] * len(c) for c in completions] if scored is None else scored
    completions, flags = _through_last_scored(completions, flags)
    lm = causal_lm(model)
    device = next(lm.parameters()).device
    width = product_width(len(prompts), max(len(p) for p in prompts))  # a 1-3-token prompt alone: wider
    ids_PL, mask_PL = _right_padded(prompts, width, pad_token_id, device)
    cache = DynamicCache()
    prompt_PLH = lm.base_model(input_ids=ids_PL, attention_mask=mask_PL, position_ids=torch.arange(
        width, device=device).expand(len(prompts), width), **with_cache(lm.base_model, cache),
        **(media or {})).last_hidden_state
    if cache.get_seq_length() != width:  # a model that ignored the cache request: the completions would lose their prompt
        raise RuntimeError(f"{type(lm).__name__} kept no key/value cache of the prompts; shared prompts need one "
                           "(UpdateSettings.share_prompts=False runs every row whole)")
    rows = torch.tensor(row_prompt, device=device)
    lengths_B = torch.tensor([len(prompts[i]) for i in row_prompt], device=device)
    hidden = [prompt_PLH[rows, lengths_B - 1]]  # _BH: predicts each row's first completion token
    fed = [c[:-1] for c in completions]  # completion tokens fed per row: all but the last
    states, starts = _completion_states(model, cache, fed, row_prompt, prompts, mask_PL, pad_token_id)
    flat_NH, targets_N = _scored_states(hidden + states, completions, flags, starts)
    return _head_logprobs(lm, flat_NH, targets_N, temperature, chunk_size)


def _completion_states(model: Any, cache: Any, fed: list[list[int]], row_prompt: list[int], prompts: list[list[int]],
                       mask_PL: torch.Tensor, pad_token_id: int) -> tuple[list[torch.Tensor], list[int]]:
    """The completion pass of `shared_prompt_logprobs` on the prompts' `cache` (selected per pass
    row in place): its hidden states [rows, C, H] (none where nothing is fed), and where each
    sample's fed tokens start in them, flattened. Rows are lanes of several completions of one
    prompt where that gives fewer rows and the model takes the lanes' mask
    (`packs_completions`), else one right-padded row per sample."""
    lm = causal_lm(model)
    device = mask_PL.device
    lanes, width_C = completion_layout([len(f) for f in fed], row_prompt, packs_completions(model))
    starts = [b * width_C for b in range(len(fed))]
    if width_C == 0:
        return [], starts
    if lanes is not None:
        # fewer rows than samples: a lane runs several completions of one prompt, each seeing
        # the prompt and itself only (a boolean mask, which only SDPA's attention takes as given)
        ids_LC, mask_LKC, positions_LC, starts = _lane_inputs(lanes, fed, row_prompt, prompts, mask_PL,
                                                             width_C, pad_token_id, device)
        cache.batch_select_indices(torch.tensor([row_prompt[lane[0]] for lane in lanes], device=device))
        return [lm.base_model(input_ids=ids_LC, attention_mask=mask_LKC, position_ids=positions_LC,
                              **with_cache(lm.base_model, cache)).last_hidden_state], starts
    rows = torch.tensor(row_prompt, device=device)
    lengths_B = torch.tensor([len(prompts[i]) for i in row_prompt], device=device)
    ids_BC, mask_BC = _right_padded(fed, width_C, pad_token_id, device)
    cache.batch_select_indices(rows)
    return [lm.base_model(input_ids=ids_BC, attention_mask=torch.cat([mask_PL[rows], mask_BC], dim=1),
                          position_ids=lengths_B[:, None] + torch.arange(width_C, device=device),
                          **with_cache(lm.base_model, cache)).last_hidden_state], starts


def completion_layout(fed: list[int], row_prompt: list[int], packs: bool) -> tuple[list[list[int]] | None, int]:
    """The completion pass's rows for samples that feed ``fed`` tokens each: its lanes
    (`completion_lanes`) where the model ``packs`` them and that gives fewer rows, else None (a
    row a sample); and its width, the longest feed, wider where the pass would run fewer than
    `FEWEST_ROWS` tokens in all (rlvr.models.product_width)."""
    width = max(fed, default=0)
    if width == 0:
        return None, 0
    width = product_width(len(fed), width)
    lanes = completion_lanes(fed, row_prompt, width) if packs else None
    if lanes is None or len(lanes) >= len(fed) or product_width(len(lanes), width) > width:
        return None, width
    return lanes, width


def completion_lanes(fed: list[int], row_prompt: list[int], width: int) -> list[list[int]]:
    """The rows of a completion pass (*lanes*), each a list of samples of one prompt whose fed
    lengths add up to at most `width` (the longest), so that the pass runs fewer padded tokens:
    first-fit, longest first, within each prompt. GRPO's completions of one prompt differ in
    length (8 rollouts of the bundled model's sums: 20-128 tokens), and a pass padded to the
    longest ran ~40% padding. A sample with nothing to feed goes in no lane. Lanes keep the order
    of their first sample, each lane's samples the order they were placed in."""
    lanes: list[list[int]] = []
    room: list[int] = []
    owner: list[int] = []
    for b in sorted((b for b in range(len(fed)) if fed[b]), key=lambda b: -fed[b]):
        lane = next((i for i in range(len(lanes)) if owner[i] == row_prompt[b] and room[i] >= fed[b]), None)
        if lane is None:
            lanes.append([])
            room.append(width)
            owner.append(row_prompt[b])
            lane = len(lanes) - 1
        lanes[lane].append(b)
        room[lane] -= fed[b]
    return sorted(lanes, key=lambda lane: lane[0])


def _lane_inputs(lanes: list[list[int]], fed: list[list[int]], row_prompt: list[int], prompts: list[list[int]],
                 mask_PL: torch.Tensor, width: int, pad_token_id: int, device: torch.device,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """A packed completion pass's inputs: ids [L, C], a boolean attention mask [L, 1, C, prompt
    width + C] (each token sees its prompt's real tokens and the tokens of its own completion up
    to itself; a pad sees the prompt only), positions [L, C] (each completion's from its
    prompt's length), and where each sample's fed tokens start in the flattened [L·C] pass."""
    ids = torch.full((len(lanes), width), pad_token_id, dtype=torch.long)
    positions = torch.zeros((len(lanes), width), dtype=torch.long)
    segment = torch.full((len(lanes), width), -1, dtype=torch.long)
    starts = [0] * len(fed)
    for i, lane in enumerate(lanes):
        offset = 0
        for b in lane:
            n = len(fed[b])
            ids[i, offset : offset + n] = torch.tensor(fed[b], dtype=torch.long)
            positions[i, offset : offset + n] = len(prompts[row_prompt[b]]) + torch.arange(n)
            segment[i, offset : offset + n] = b
            starts[b] = i * width + offset
            offset += n
    segment = segment.to(device)
    own = (segment[:, :, None] == segment[:, None, :]) & (segment[:, :, None] >= 0) \
        & torch.ones(width, width, dtype=torch.bool, device=device).tril()
    owners = torch.tensor([row_prompt[lane[0]] for lane in lanes], device=device)
    prompt = mask_PL.bool()[owners][:, None, :].expand(-1, width, -1)
    mask = torch.cat([prompt, own], dim=2)[:, None]
    return ids.to(device), mask, positions.to(device), starts


def _scored_states(hidden: list[torch.Tensor], completions: list[list[int]], flags: list[list[int]],
                   starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden_NH, targets_N): the flagged completion tokens, rows in order, and the states that
    predict them. ``hidden`` is the prompts' last states [B, H], then the completion pass's
    [rows, C, H] if it ran: row b's token 0 is predicted by its prompt's last state, token j by
    the completion pass's flattened state ``starts[b]`` + j − 1."""
    device = hidden[0].device
    targets_N = torch.tensor([t for c, f in zip(completions, flags) for t, keep in zip(c, f) if keep],
                             dtype=torch.long, device=device)
    if not len(targets_N):
        return hidden[0][:0], targets_N
    rows = len(completions)
    picks = torch.cat([torch.cat([torch.tensor([b]), rows + starts[b] + torch.arange(len(c) - 1)])
                       [torch.tensor(f, dtype=torch.bool)] for b, (c, f) in enumerate(zip(completions, flags)) if c])
    return torch.cat([hidden[0], *(h.flatten(0, 1) for h in hidden[1:])])[picks.to(device)], targets_N


def _through_last_scored(completions: list[list[int]], scored: Sequence[Sequence[int]],
                         ) -> tuple[list[list[int]], list[list[int]]]:
    """Each row's completion and flags cut after its last flagged token (nothing, where none is):
    later tokens predict nothing scored and no scored token attends to them."""
    if len(scored) != len(completions) or any(len(f) != len(c) for f, c in zip(scored, completions)):
        raise ValueError("scored needs one flag per completion token of each row")
    ends = [max((i + 1 for i, f in enumerate(flags) if f), default=0) for flags in scored]
    return [c[:n] for c, n in zip(completions, ends)], [list(f[:n]) for f, n in zip(scored, ends)]


def _right_padded(seqs: list[list[int]], width: int, pad_token_id: int, device: torch.device,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists as right-padded [len(seqs), width] ids and their 0/1 attention mask, on `device`."""
    ids, mask = padded_rows(seqs, pad_token_id, left=False, width=width)
    return ids.to(device), mask.to(device)


def _head_logprobs(lm: Any, hidden_NH: torch.Tensor, targets_N: torch.Tensor, temperature: float,
                   chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs_N, entropy_N) of `targets_N` under the LM head on `hidden_NH`, chunk by chunk."""
    head = lm.get_output_embeddings()
    if getattr(head, "bias", None) is not None:
        raise NotImplementedError("LM heads with a bias are not supported yet")
    pieces = [
        _HeadLogprobs.apply(hidden_NH[i : i + chunk_size], head.weight, targets_N[i : i + chunk_size], temperature)
        for i in range(0, hidden_NH.shape[0], chunk_size)
    ]
    if not pieces:  # nothing to score: empty, but still part of the graph, so a backward through it is a no-op
        empty_N = hidden_NH.sum(-1).to(torch.promote_types(hidden_NH.dtype, torch.float32))
        return empty_N, empty_N
    return torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])


def token_budget_batches(lengths: list[int], max_tokens: int | None, max_rows: int | None = None) -> list[list[int]]:
    """Consecutive positions of `lengths` (rows in the order given) cut into micro-batches of at
    most `max_rows` rows and at most `max_tokens` padded tokens (rows × the longest row); a row
    longer than that goes alone. The activations a backward pass keeps grow with the padded
    tokens of a micro-batch, so the token cap is what bounds memory when rows are long."""
    out: list[list[int]] = []
    width = 0
    for i, n in enumerate(lengths):
        if out and (max_rows is None or len(out[-1]) < max_rows) and \
                (max_tokens is None or (len(out[-1]) + 1) * max(width, n) <= max_tokens):
            out[-1].append(i)
            width = max(width, n)
        else:
            out.append([i])
            width = n
    return out


def packed_batch(rows: list[list[Tokenized]], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Rows of one or more sequences each, right-padded: input ids, a [B, 1, T, T] boolean mask
    (causal within each sequence, nothing across), positions restarting at 0 for each sequence,
    the trained-token mask, and which sequence of its row each token is (-1 = padding)."""
    width = max(sum(len(t.ids) for t in row) for row in rows)
    shape = (len(rows), width)
    ids = torch.full(shape, pad_token_id, dtype=torch.long)
    target = torch.zeros(shape, dtype=torch.bool)
    pos = torch.zeros(shape, dtype=torch.long)
    seg = torch.full(shape, -1, dtype=torch.long)
    for b, row in enumerate(rows):
        offset = 0
        for k, t in enumerate(row):
            n = len(t.ids)
            ids[b, offset : offset + n] = torch.tensor(t.ids)
            target[b, offset : offset + n] = torch.tensor(t.mask, dtype=torch.bool)
            target[b, offset] = False  # a sequence's first token is predicted by nothing of its own
            pos[b, offset : offset + n] = torch.arange(n)
            seg[b, offset : offset + n] = k
            offset += n
    same = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] >= 0)
    attend = (same & torch.ones(width, width, dtype=torch.bool).tril()) | torch.eye(width, dtype=torch.bool)
    return {"input_ids": ids.to(device), "attention_mask": attend[:, None].to(device), "position_ids": pos.to(device),
            "target": target.to(device), "segment": seg.to(device)}


def packed_logprobs(model: Any, batch: dict[str, torch.Tensor], chunk: int) -> torch.Tensor:
    """Log-probs of a `packed_batch`'s trained tokens (0 elsewhere)."""
    return token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["target"],
                          chunk_size=chunk, position_ids_BT=batch["position_ids"])[0]
