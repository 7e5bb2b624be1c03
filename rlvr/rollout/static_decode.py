"""Decode steps for Llama-family models on a preallocated KV cache, without Hugging Face's per-step
machinery.

Why: at batch 64 on CPU, Hugging Face's cached decode spends a third of each step outside the
matrix products: `DynamicCache` concatenates the whole cache every step, masks are rebuilt, and
grouped-query attention repeats the keys and values for every query head (docs/LOG.md). This
module runs the same weights with
- the prompt's keys and values kept once per prompt and shared by its G samples, with a
  preallocated buffer per layer for the sampled tokens only, written in place one column per
  step (grown in blocks when full);
- the query, key and value projections fused into one matrix product, and the MLP's gate and up
  projections into another (rlvr.rollout.weights: on the CPU, in fp32 or bf16, the forms a
  probe of this CPU found fastest for each row count, with one or two copies of the weights, the
  output head's included, e.g. bf16 oneDNN-packed copies, and float16 copies for one row;
  elsewhere [in, out] matrices, ~0.8× the model's size). The engine rebuilds them when a
  parameter's version counter shows a change, so learner updates are always seen;
- attention for the single new token over the key/value heads with the query heads of each
  group stacked, so nothing is repeated: one `scaled_dot_product_attention` call a layer over a
  row's own buffers, two batched matrix products where prompts are shared;
- finished rows kept in the buffers until a quarter of them are dead, then removed in one
  compaction, instead of a copy of the whole cache at every step where one row finishes.

On CPU the projections and the output head can run on float16 copies of the weights
(`engine.dtype = "float16"`, `weights.Float16`): fbgemm's prepacked kernel reads half the bytes per
token and never repacks the weight; or, on AVX-512 CPUs, on weight-only int8 copies
(`engine.dtype = "int8"`, `weights.Int8`): half of bfloat16's bytes (docs/performance.md).

On a CUDA device each step is replayed as a CUDA graph (``graphs``): one launch instead of a few
hundred small kernels, which is what bounds a small model's decode step on a GPU (13-28 ms a
token at batch 1 on an H200, launched kernel by kernel; docs/performance.md). A graph needs fixed
shapes, so a step in that form writes the new key and value at a column held in a tensor and
attends over the buffers' every column, the columns not yet written masked; it is captured again
after each layout change (a compaction when a quarter of the rows have finished, a buffer growth
every `GROW` columns): 7-9 captures for 24 rows of 5-150 tokens on the H200. Not captured: models
whose rotary embedding recomputes its frequencies from the positions (dynamic and LongRoPE
scaling: a host sync a graph cannot hold), and steps while any module has a hook.

The prefill still runs the Hugging Face forward (it is one call per prompt batch); its cache is
the shared prompt part, used as it is (no copy). The model's own modules compute the norms, the
rotary embedding (any rope scaling it has) and the activation, so numerics match the Hugging Face
path to float rounding. Supported: the architectures in `SUPPORTED` without sliding windows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module
from transformers import DynamicCache, PreTrainedModel

from rlvr.rollout.forms import partial_qkv_bias
from rlvr.rollout.weights import LAZY_AFTER, FusedWeights

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "mistral", "qwen2")
GROW = 64  # key/value buffer columns added at a time
COMPACT_BELOW = 0.75  # compact when fewer than this fraction of the buffer's rows are still running
SHARE_FROM = 1024
"""Share prompts' keys and values when that saves reading at least this many prompt columns per
step ((n - 1) · prompts · prompt width): below it the shared path's extra small ops cost more
than the reads they save (fp32 on an Intel Xeon, 54-token prompts: 0.97-0.99× at batch 8,
1.06× at 64; 454-token prompts 1.10× at 8, 1.49× at 64; docs/LOG.md)."""


def cache_tensors(cache: DynamicCache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every layer's keys and values (P × kv heads × T × head dim); TypeError for a layer that
    holds no key/value tensors."""
    keys, values = [], []
    for layer in cache.layers:
        k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
        if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
            raise TypeError(f"expected a key/value cache layer, got {type(layer).__name__}")
        keys.append(k)
        values.append(v)
    return keys, values


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the static decoder cannot run `model`, or None when it can."""
    config = model.config
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model decodes through its own forward (its prefill takes the pixel inputs)"
    if config.model_type not in SUPPORTED:
        return f"model type {config.model_type!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not implemented"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1 is not implemented"
    layer = model.model.layers[0]
    if layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
        return "biases on the output or MLP projections are not implemented"
    if partial_qkv_bias(model):
        return "a bias on some of the query, key and value projections but not all is not implemented"
    if config.hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
        return f"activation {config.hidden_act!r} is not covered"
    return None


class StaticDecoder:
    """The running batch of one `generate` chunk: its key/value buffers, positions and layout.

    The prompt's keys and values are shared, not copied: each prompt keeps one row of them (the
    prefill's own cache), and its samples' queries attend to that row together. Only the tokens
    sampled after the prompt have per-sample buffers. The buffers' rows (*slots*) are laid out
    prompt-major, `n` slots per prompt row: slot s belongs to prompt row s // n, and the
    generated buffers are [prompt rows, kv heads, n, columns, head dim], so one batched matrix
    product over (prompt row, kv head) scores all of a prompt's samples against its keys (the
    query heads of each kv group and the n samples stacked: n·group query rows instead of
    group), reading the prompt's keys once for its n samples instead of n times.

    With one sample per prompt row (n = 1: a call with one sample per prompt, rows left on their
    own by a compaction, or prompts too short for sharing to pay, `SHARE_FROM`) the prompt's
    columns are copied in front of each row's own buffers instead (*joined*), so attention is
    one product over one buffer: splitting it in two cost ~4-10% at batch 1 (docs/LOG.md).

    The running rows are `self.slots[i]` for i in range(len(self.slots)), in the order the engine
    tracks them (always ascending: a layout change keeps the order).
    """

    def __init__(
        self, model: PreTrainedModel, weights: FusedWeights, cache: DynamicCache, mask_PT: torch.Tensor, n: int,
        *, fixed_shapes: bool = False, graphs: StepGraphs | None = None, new_tokens: int = 0, exact: bool = False,
    ) -> None:
        """`cache` and `mask_PT` hold one row per prompt, shared by its n sample rows; ``new_tokens``:
        the most the call may sample (it decides when the weights' lazy forms start, `LAZY_AFTER`).

        ``fixed_shapes``: run each step in the fixed shapes a CUDA graph needs (`_fixed_forward`);
        ``graphs`` (on a CUDA device): capture it and replay it, with the captures of ``graphs``'
        other decoders sharing one memory pool. Fixed shapes without capture serve the tests: they
        must give what the plain step gives.

        ``exact``: attention in float64, as the model's own `rlvr.attention.exact_sdpa` (matched
        numerics, rlvr.rollout.matched): the key/value buffers held in float64 (4 times the bytes
        of bf16's), the queries not scaled in the rotation (the scores are, in float64), and each
        step's attention output rounded once to the model's dtype."""
        config = model.config
        self.model, self.weights = model, weights
        self.fixed, self.graphs = fixed_shapes or graphs is not None, graphs
        self._layout = 0  # counts layout changes: a graph replays only on the layout it was captured on
        self._graph: _StepGraph | None = None  # the last captured step
        self._tok_B: torch.Tensor | None = None  # fixed shapes: each slot's input token
        self._col_t: torch.Tensor | None = None  # fixed shapes: the column the step writes
        self._qkv_seen: list[torch.Tensor] | None = None  # a float16 step's q/k/v projections (`step`)
        # the weights' lazy forms (`LAZY_AFTER`) run from this call's `_rent`-th step that has them on;
        # from the first where the call starts with one row and asks for that many tokens or more
        self._lazy_steps = 0
        self._overflowed = False  # a step of this call overflowed a float16 product: none from then on
        self._rent = 0 if new_tokens >= LAZY_AFTER and len(mask_PT) * n == 1 else LAZY_AFTER
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        # attention's score scale 1/√D on the query heads' rows of the rotation (`_rotation`), made here:
        # a captured step cannot copy a list to the device; exact: 1, and attention scales its scores
        self.exact = exact
        self.score_scale = self.head_dim**-0.5 if exact else 1.0
        self.head_scale = torch.tensor([1.0 if exact else self.head_dim**-0.5] * self.n_heads + [1.0] * self.n_kv,
                                       device=mask_PT.device)[:, None]
        self.prompt_keys: list[torch.Tensor] = []  # _P,kv,W,D per layer; empty once joined
        self.prompt_values: list[torch.Tensor] = []
        for keys, values in zip(*cache_tensors(cache)):  # contiguous: a no-op for transformers' own caches today
            self.prompt_keys.append(keys.to(torch.float64) if exact else keys.contiguous())
            self.prompt_values.append(values.to(torch.float64) if exact else values.contiguous())
        # left padding: the dtype's lowest value on a prompt row's pad columns, added to its scores
        # before the softmax (once joined, the row covers all of its buffer's columns, zeros past the
        # prompt). Not -inf: a CPU SDPA kernel that splits the keys into blocks gave NaN for a block
        # all -inf (pytorch/pytorch#127055: 512 or more pad columns), where a finite lowest value
        # still weighs exp(lowest - max) = 0
        self.neg_PW = torch.zeros(mask_PT.shape, dtype=self.prompt_keys[0].dtype, device=mask_PT.device)
        self.neg_PW.masked_fill_(mask_PT == 0, torch.finfo(self.neg_PW.dtype).min)
        self.pos_B = mask_PT.sum(-1).repeat_interleave(n)  # each slot's next position: real prompt tokens only
        prompts = len(mask_PT)
        if (n - 1) * prompts * mask_PT.shape[1] < SHARE_FROM:  # a prompt row of its own for every sample
            rows = torch.arange(prompts, device=mask_PT.device).repeat_interleave(n)
            self.prompt_keys = [k[rows] for k in self.prompt_keys]
            self.prompt_values = [v[rows] for v in self.prompt_values]
            self.neg_PW, prompts, n = self.neg_PW[rows], len(rows), 1
        self.n = n
        shape = (prompts, self.n_kv, n, GROW, self.head_dim)
        # sampled tokens only; zeros in fixed shapes, where the columns not yet written are read
        # (with a probability of exactly 0, and 0 times a NaN left by `new_empty` would be NaN)
        new = self.prompt_keys[0].new_zeros if self.fixed else self.prompt_keys[0].new_empty
        self.keys = [new(shape) for _ in self.prompt_keys]
        self.values = [new(shape) for _ in self.prompt_keys]
        self.col = 0  # the generated buffers' column the next token's key and value go to
        self.slots = torch.arange(prompts * n, device=mask_PT.device)
        if n == 1:
            self._join()

    def _join(self) -> None:
        """n = 1: put each row's prompt columns in front of its sampled-token buffers."""
        width = self.neg_PW.shape[1]
        self.keys = [torch.cat([p[:, :, None], k], dim=3) for p, k in zip(self.prompt_keys, self.keys)]
        self.values = [torch.cat([p[:, :, None], v], dim=3) for p, v in zip(self.prompt_values, self.values)]
        past_prompt = self.neg_PW.new_zeros((len(self.neg_PW), self.keys[0].shape[3] - width))
        self.neg_PW = torch.cat([self.neg_PW, past_prompt], 1)
        self.prompt_keys, self.prompt_values = [], []
        self.col += width
        self._layout += 1

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only running rows `idx` (indices into the current running rows)."""
        self.slots = self.slots[idx]
        if len(self.slots) < COMPACT_BELOW * len(self.pos_B):
            self._relayout()

    def _relayout(self) -> None:
        """Drop the finished slots. A prompt row keeps as many slots as its busiest prompt has
        running samples, while that leaves the buffers at least COMPACT_BELOW full; otherwise
        every running row gets a prompt row of its own (a copy of its prompt's keys and values,
        n = 1)."""
        live, n = self.slots, self.n
        owner = live // n  # ascending, since the slots are
        counts = torch.bincount(owner, minlength=len(self.neg_PW))
        kept = counts.nonzero().squeeze(-1)
        width = int(counts.max())
        if len(live) >= COMPACT_BELOW * len(kept) * width:  # the shared layout stays full enough
            row_of = torch.zeros_like(counts)
            row_of[kept] = torch.arange(len(kept), device=live.device)
            starts = counts.cumsum(0) - counts
            new_slots = row_of[owner] * width + torch.arange(len(live), device=live.device) - starts[owner]
            prompt_rows = kept
        else:
            width, new_slots, prompt_rows = 1, torch.arange(len(live), device=live.device), owner
        source = live.new_full((len(prompt_rows) * width,), int(live[0]))  # padding slots copy any live slot
        source[new_slots] = live
        self.prompt_keys = [k[prompt_rows] for k in self.prompt_keys]
        self.prompt_values = [v[prompt_rows] for v in self.prompt_values]
        self.neg_PW = self.neg_PW[prompt_rows]

        def gather(buffer: torch.Tensor) -> torch.Tensor:  # _P,kv,n,T,D → the new layout's slots
            picked = buffer[source // n, :, source % n]  # _S,kv,T,D
            return picked.view(len(prompt_rows), width, *picked.shape[1:]).transpose(1, 2).contiguous()

        self.keys = [gather(k) for k in self.keys]
        self.values = [gather(v) for v in self.values]
        self.pos_B, self.slots, self.n = self.pos_B[source], new_slots, width
        self._layout += 1
        if width == 1 and self.prompt_keys:
            self._join()

    def _grow(self) -> None:
        def grown(buffer: torch.Tensor) -> torch.Tensor:
            new = buffer.new_zeros if self.fixed else buffer.new_empty
            return torch.cat([buffer, new((*buffer.shape[:3], GROW, buffer.shape[4]))], dim=3)

        self._layout += 1
        self.keys = [grown(k) for k in self.keys]
        self.values = [grown(v) for v in self.values]
        if not self.prompt_keys:  # joined: the mask spans the buffers
            self.neg_PW = torch.cat([self.neg_PW, self.neg_PW.new_zeros((len(self.neg_PW), GROW))], 1)

    def step(self, tok_R: torch.Tensor) -> torch.Tensor:
        """Feed one token per running row; return the next-token logits of the running rows.

        Where some products run in float16 (bf16 weights on a CPU where that is faster, `FORMS`'
        "half"), an activation beyond float16's range would make them inf. From the attention
        output, the MLP or the residual stream inf or NaN reaches every logit of its row (through
        the norms); from the query, key and value projections it might not (a key of -inf only
        scores -inf, and stays in the cache). So a step whose row counts run a float16 product
        checks its logits and its q/k/v projections (~20 µs at one row), and a step that
        overflowed runs again, its keys and values written again at the same column, and the rest of
        the call without float16 forms (the engine's weights untouched: the next call tries again,
        so no call's numbers depend on an earlier one's)."""
        if self.col == self.keys[0].shape[3]:
            self._grow()
        weights = self.weights
        rows = len(self.pos_B), len(self.pos_B) if self.fixed else len(tok_R)  # the layers', the head's
        if weights.has_lazy:  # lazy forms run after this call's first `_rent` steps that have them
            self._lazy_steps += weights.lazy_at(*rows)
            weights.switch.on = self._lazy_steps > self._rent and not self._overflowed
        check = weights.fp16_at(*rows)
        seen: list[torch.Tensor] = []
        self._qkv_seen = seen if check else None
        logits_RV = self._fixed_step(tok_R) if self.fixed else self._step(tok_R)
        self._qkv_seen = None
        if check and not _finite(logits_RV, torch.cat(seen, 1)[self.slots]):
            logits_RV = self._again_without_fp16(tok_R)
        return logits_RV

    def _again_without_fp16(self, tok_R: torch.Tensor) -> torch.Tensor:
        """The step just run, run again at the same column and position, and the rest of the call,
        without float16 products (`step`)."""
        log.warning("a decode step with float16 products gave values that are not finite (float16 holds up "
                    "to 65504): it runs again, and the rest of this call in the model's own dtype")
        self._overflowed = True
        if self.weights.fp16_waits:  # the plans' other forms, as before the switch was on
            self.weights.switch.on = False
        else:  # weights of this call's own, without float16
            self.weights = self.weights.without_fp16()
        self._layout += 1  # a captured step (none on a CPU today) would hold the old weights
        self.col -= 1
        self.pos_B -= 1
        logits_RV = self._fixed_step(tok_R) if self.fixed else self._step(tok_R)
        if not _finite(logits_RV):
            log.warning("the decoder's logits are not finite in the model's own dtype either: the model "
                        "itself gives them, not float16")
        return logits_RV

    def _step(self, tok_R: torch.Tensor) -> torch.Tensor:
        batch, model = len(self.pos_B), self.model.model
        embedded_R1H = model.embed_tokens(tok_R[:, None])
        if len(tok_R) == batch:
            h_B1H = embedded_R1H
        else:  # finished slots still in the buffers run on zeros; their outputs are never read
            h_B1H = embedded_R1H.new_zeros((batch, *embedded_R1H.shape[1:]))
            h_B1H[self.slots] = embedded_R1H
        h_B1H = self._layers(h_B1H, self.col)
        self.col += 1
        self.pos_B += 1
        return self._logits(model.norm(h_B1H[self.slots]))

    def _fixed_step(self, tok_R: torch.Tensor) -> torch.Tensor:
        """`step` in fixed shapes: every slot runs (a finished one on the last token it was given,
        a padding slot after a compaction on token 0; their outputs are never read), replayed from
        the layout's CUDA graph once captured."""
        batch = len(self.pos_B)
        if self._tok_B is None or len(self._tok_B) != batch:
            self._tok_B = tok_R.new_zeros(batch)
        self._tok_B[self.slots] = tok_R
        graph = self._graph
        if graph is not None and graph.layout == self._layout and not _hooked(self.model.lm_head):
            graph.graph.replay()
            logits_BV = graph.logits_BV
        else:  # a new layout: run the step, and capture it where that applies
            self._graph = None  # (a graph holds the column tensor it was captured with)
            self._col_t = torch.tensor([self.col], device=self.pos_B.device)
            if self.graphs is None or graphs_unsupported(self.model) or _any_hooks(self.model):
                logits_BV = self._fixed_forward()  # a hook is Python, to be run at every step
            else:
                logits_BV, captured = self.graphs.run_and_capture(self._fixed_forward)
                self._graph = _StepGraph(*captured, self._layout)
        self.col += 1
        return logits_BV[self.slots]

    def _fixed_forward(self) -> torch.Tensor:
        """Every slot's step in fixed shapes: token `_tok_B`, position `pos_B`, key/value column
        `_col_t`, each advanced in place; the next-token logits of every slot."""
        model = self.model.model
        assert self._tok_B is not None and self._col_t is not None
        h_B1H = self._layers(model.embed_tokens(self._tok_B[:, None]), self._col_t)
        self._col_t += 1
        self.pos_B += 1
        return self._logits(model.norm(h_B1H))

    def _logits(self, last_R1H: torch.Tensor) -> torch.Tensor:
        # hooks see what a forward gives them (in fixed shapes, every slot's row, dead ones too)
        if self.weights.head is None or _hooked(self.model.lm_head):
            return self.model.lm_head(last_R1H)[:, -1]
        return self.weights.head(last_R1H[:, -1])

    def _rotation(self, h_B1H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary embedding at each slot's position, for the query and key heads together
        (_B,heads+kv,D each; the model's own module gives cos and sin, any rope scaling
        included): x·cos + rotate_half(x)·sin, with rotate_half(x) = (-x₂, x₁) = roll(x, D/2)
        times (-1, +1) on the halves, the sign moved into sin. The query heads' rows are also
        scaled by 1/√D, attention's score scale, so no layer scales its scores (exactly the same
        numbers in bf16 and fp32 where 1/√D is a power of two, as for D = 64; else the scaled cos
        and sin computed in at least fp32 and rounded once to the model's dtype). A few ops a step
        where the rotary and the scaling took 15-17 a layer."""
        wide = torch.promote_types(h_B1H.dtype, torch.float32)  # the module reads only x's dtype and device
        cos, sin = self.model.model.rotary_emb(h_B1H[..., :1].to(wide), self.pos_B[:, None])  # _B1D each
        half = sin.shape[-1] // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        scale = self.head_scale.to(wide)
        return (cos * scale).to(h_B1H.dtype), (sin * scale).to(h_B1H.dtype)

    def _layers(self, h_B1H: torch.Tensor, col: int | torch.Tensor) -> torch.Tensor:
        """The decoder layers on one new token a slot, its key and value written at column `col` of
        the buffers: an int, and attention reads columns up to it; or a one-element tensor (fixed
        shapes), and attention reads every column, those after `col` masked."""
        batch, n = len(self.pos_B), self.n
        prompts, width = self.neg_PW.shape
        model = self.model.model
        kv, group, d = self.n_kv, self.n_heads // self.n_kv, self.head_dim
        cos_qk, sin_qk = self._rotation(h_B1H)
        joined = not self.prompt_keys
        upto = None if isinstance(col, torch.Tensor) else col + 1  # the columns attention reads
        # joined: the mask over the buffers' columns read, _B11T; shared: over the prompt's, _P111W
        neg = self.neg_PW[:, None, None, :upto] if joined else self.neg_PW[:, None, None, None]
        ahead_T: torch.Tensor | float = 0.0  # fixed shapes: -inf on the columns after `col`
        if isinstance(col, torch.Tensor):
            columns = torch.arange(self.keys[0].shape[3], device=col.device)
            ahead_T = torch.zeros(columns.shape, dtype=neg.dtype, device=col.device).masked_fill_(columns > col, float("-inf"))
        if joined:  # the joined path's attention mask, made once a step
            mask = neg if isinstance(ahead_T, float) else neg + ahead_T
        q_dim, kv_dim = self.n_heads * d, kv * d
        for i, layer in enumerate(model.layers):
            x_BH = layer.input_layernorm(h_B1H)[:, 0]
            qkv = self.weights.qkv[i](x_BH)  # with its bias, inside the product (`Form`)
            if self._qkv_seen is not None:  # a step with float16 products: checked in `step`
                self._qkv_seen.append(qkv)
            qk = qkv[:, : q_dim + kv_dim].view(batch, self.n_heads + kv, d)
            qk = qk * cos_qk + qk.roll(d // 2, -1) * sin_qk  # rotary, the queries also scaled (`_rotation`)
            q, k = qk[:, : self.n_heads].view(batch, kv, group, d), qk[:, self.n_heads :].view(batch, kv, 1, d)
            v = qkv[:, q_dim + kv_dim :].view(batch, kv, 1, d)
            if joined:  # n = 1, the prompt in each row's own buffers: one product, as without sharing
                keys, values = self.keys[i][:, :, 0], self.values[i][:, :, 0]  # _B,kv,T,D
                _put(keys, 2, col, k)
                _put(values, 2, col, v)
                # one fused op for scores, softmax and the weighted values (the queries are scaled
                # already), as the model's own SDPA attention: the engine 1.12-1.17× faster at one
                # row than with two batched products and a softmax, 1.11× at 8 (bf16, Zen 4; LOG)
                attn_BH = F.scaled_dot_product_attention(q.to(keys.dtype), keys[:, :, :upto], values[:, :, :upto],
                                                         attn_mask=mask, scale=self.score_scale)
                attn_BH = attn_BH.to(h_B1H.dtype).reshape(batch, q_dim)
            else:  # shared: a prompt row's n·group queries of a kv head in one product on its prompt
                keys, values = self.keys[i], self.values[i]  # _P,kv,n,T,D
                _put(keys, 3, col, k.view(prompts, n, kv, 1, d).transpose(1, 2))
                _put(values, 3, col, v.view(prompts, n, kv, 1, d).transpose(1, 2))
                q_PKNGD = q.view(prompts, n, kv, group, d).transpose(1, 2).to(keys.dtype)
                if self.exact:  # the scores' scale, in float64
                    q_PKNGD = q_PKNGD * self.score_scale
                on_own = q_PKNGD @ keys[:, :, :, :upto].transpose(-1, -2) + ahead_T  # _P,kv,n,G,t
                on_prompt = q_PKNGD.reshape(prompts, kv, n * group, d) @ self.prompt_keys[i].transpose(-1, -2)
                on_prompt = on_prompt.view(prompts, kv, n, group, width) + neg
                probs = torch.cat([on_prompt, on_own], dim=-1).softmax(-1)
                out = probs[..., :width].reshape(prompts, kv, n * group, width) @ self.prompt_values[i]
                out_PKNGD = out.view(prompts, kv, n, group, d) + probs[..., width:] @ values[:, :, :, :upto]
                attn_BH = out_PKNGD.transpose(1, 2).reshape(batch, q_dim).to(h_B1H.dtype)
            h_B1H = h_B1H + self.weights.o[i](attn_BH)[:, None]
            x_BH = layer.post_attention_layernorm(h_B1H)[:, 0]
            gate, up = self.weights.gate_up[i](x_BH).chunk(2, dim=-1)
            h_B1H = h_B1H + self.weights.down[i](layer.mlp.act_fn(gate) * up)[:, None]
        return h_B1H


class StepGraphs:
    """What an engine's decode-step captures share: a side stream, one memory pool, and the last
    graph captured, kept for good (PyTorch's allocator lets a capture share a pool only while a
    graph still holds it: a capture after all of them were freed fails an internal assert, as
    the H200 showed). So the pool stays reserved between calls: one step's activations and
    logits, e.g. ~0.1 GB for 256 rows of Qwen2-0.5B."""

    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.last: torch.cuda.CUDAGraph | None = None
        self.captures = 0

    def run_and_capture(
        self, step: Callable[[], torch.Tensor]
    ) -> tuple[torch.Tensor, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
        """Run `step` (its effects happen: this is the step the caller is at), then capture it:
        what it returned, and the graph with the tensor its replays write. The step runs first on
        the stream the capture uses, as its warm-up (cuBLAS sets up its workspace on a stream's
        first product). Not `torch.cuda.graph`, which empties the allocator's cache at every
        capture. thread_local: another thread's CUDA calls (a partial rollout's weight update,
        the server's batcher) do not break the capture.

        A capture that fails raises: what a failed capture leaves (the allocator's and the CUDA
        generator's capture state) is not safe to go on from. `graphs_unsupported` screens out
        the known causes first."""
        current = torch.cuda.current_stream(self.stream.device)  # the engine's device, whichever is current
        self.stream.wait_stream(current)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            out = step()
            graph.capture_begin(self.pool, capture_error_mode="thread_local")
            try:  # recorded, not run: what the step writes stays as it is
                captured = step()
            finally:
                try:
                    graph.capture_end()
                except RuntimeError as error:
                    raise RuntimeError(
                        "the static decoder's step could not be captured as a CUDA graph; please report it "
                        "with the model's config. engine.decoder = \"hf\" decodes without the static "
                        "decoder") from error
        current.wait_stream(self.stream)
        self.last, self.captures = graph, self.captures + 1
        return out, (graph, captured)


def graphs_unsupported(model: PreTrainedModel) -> str | None:
    """Why `model`'s decode step cannot be captured as a CUDA graph, or None when it can: its
    rotary embedding recomputes its frequencies from the positions each call (transformers'
    dynamic and LongRoPE scaling), comparing them on the host."""
    rope = getattr(model.model.rotary_emb, "rope_type", "default")
    if not isinstance(rope, str) or "dynamic" in rope or rope == "longrope":
        return f"rope type {rope!r} updates its frequencies on the host"
    return None


class _StepGraph(NamedTuple):
    """A captured decode step, the tensor its replays write every slot's logits to, and the
    layout it was captured on."""

    graph: torch.cuda.CUDAGraph
    logits_BV: torch.Tensor
    layout: int


def _finite(*tensors: torch.Tensor) -> bool:
    """Whether every value of `tensors` is finite: from each one's least and greatest value (NaN
    where it holds one), a third of `isfinite(...).all()`'s time on a step's logits and q/k/v
    (62 against 193 µs at one row of the bundled model)."""
    ends = [end for t in tensors if t.numel() for end in torch.aminmax(t)]
    return not ends or bool(torch.isfinite(torch.stack(ends)).all())


def _put(buffer: torch.Tensor, dim: int, col: int | torch.Tensor, value: torch.Tensor) -> None:
    """Write `value` (size 1 along `dim`) at column `col` of `buffer`, in place."""
    if isinstance(col, torch.Tensor):
        buffer.index_copy_(dim, col, value.to(buffer.dtype))
    else:
        buffer.narrow(dim, col, 1).copy_(value)


def _any_hooks(model: torch.nn.Module) -> bool:
    """Whether any module of `model` has a forward hook (a replayed graph would skip them)."""
    return _hooked(model) or any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def _hooked(module: torch.nn.Module) -> bool:
    """Whether running `module` would call a forward hook (its own or a global one)."""
    return bool(module._forward_hooks or module._forward_pre_hooks
                or nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
