"""Decode steps for Llama-family models on a preallocated KV cache, without Hugging Face's per-step
machinery.

Why: at batch 64 on CPU, Hugging Face's cached decode spends a third of each step outside the
matrix products: `DynamicCache` concatenates the whole cache every step, masks are rebuilt, and
grouped-query attention repeats the keys and values for every query head (docs/LOG.md). This
module runs the same weights with
- one preallocated key/value buffer per layer, written in place one column per step (grown in
  blocks when full);
- the query, key and value projections fused into one matrix product, and the MLP's gate and up
  projections into another, all stored as contiguous [in, out] matrices (a copy of the layer
  weights, ~0.8× the model's size; the engine rebuilds it when a parameter's version counter
  shows a change, so learner updates are always seen);
- attention for the single new token as two batched matrix products over the key/value heads,
  with the query heads of each group stacked, so nothing is repeated;
- finished rows kept in the buffers until a quarter of them are dead, then removed in one
  compaction, instead of a copy of the whole cache at every step where one row finishes.

The prefill still runs the Hugging Face forward (it is one call per prompt batch); its cache is
copied into the buffers. The model's own modules compute the norms, the rotary embedding (any
rope scaling it has) and the activation, so numerics match the Hugging Face path to float
rounding. Supported: the architectures in `SUPPORTED` without sliding windows.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

SUPPORTED = ("llama", "mistral", "qwen2")
GROW = 64  # key/value buffer columns added at a time
COMPACT_BELOW = 0.75  # compact when fewer than this fraction of the buffer's rows are still running


def unsupported_reason(model: PreTrainedModel) -> str | None:
    """Why the static decoder cannot run `model`, or None when it can."""
    config = model.config
    if config.model_type not in SUPPORTED:
        return f"model type {config.model_type!r} is not one of {', '.join(SUPPORTED)}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention is not implemented"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1 is not implemented"
    layer = model.model.layers[0]
    if layer.self_attn.o_proj.bias is not None or layer.mlp.down_proj.bias is not None:
        return "biases on the output or MLP projections are not implemented"
    if config.hidden_act not in ("silu", "swish", "gelu", "gelu_pytorch_tanh", "relu"):
        return f"activation {config.hidden_act!r} is not covered"
    return None


class FusedWeights:
    """The decoder's weights, copied from the model's current parameters as [in, out] matrices
    (`x @ W` on a contiguous [in, out] matrix ran ~15% faster than `nn.Linear`'s `x @ W.T` at
    batch 64 here), with q/k/v fused into one matrix and the MLP's gate/up into another."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.qkv: list[torch.Tensor] = []
        self.qkv_bias: list[torch.Tensor | None] = []
        self.o: list[torch.Tensor] = []
        self.gate_up: list[torch.Tensor] = []
        self.down: list[torch.Tensor] = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.qkv.append(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).T.contiguous())
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.qkv_bias.append(torch.cat(biases) if all(b is not None for b in biases) else None)
            self.o.append(attn.o_proj.weight.T.contiguous())
            self.gate_up.append(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).T.contiguous())
            self.down.append(mlp.down_proj.weight.T.contiguous())


class StaticDecoder:
    """The running batch of one `generate` chunk: its key/value buffers, positions and valid columns.

    Rows are addressed two ways: a *slot* is a row of the buffers; the running rows are
    `self.slots[i]` for i in range(len(self.slots)), in the order the engine tracks them.
    """

    def __init__(
        self, model: PreTrainedModel, weights: FusedWeights, cache: DynamicCache, mask_PT: torch.Tensor, n: int
    ) -> None:
        """`cache` and `mask_PT` hold one row per prompt; each is copied to its n sample rows."""
        config = model.config
        self.model, self.weights = model, weights
        self.n_heads, self.n_kv = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5
        prompts, width = mask_PT.shape
        batch = prompts * n
        mask_BT = mask_PT.repeat_interleave(n, 0)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        for layer in cache.layers:
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
                raise TypeError(f"expected a key/value cache layer, got {type(layer).__name__}")
            k = keys.new_empty((batch, self.n_kv, width + GROW, self.head_dim))
            v = torch.empty_like(k)
            # sample rows i·n … i·n + n - 1 get prompt i's cache (a broadcast copy, no repeat tensor)
            k.view(prompts, n, *k.shape[1:])[:, :, :, :width] = keys[:, None]
            v.view(prompts, n, *v.shape[1:])[:, :, :, :width] = values[:, None]
            self.keys.append(k)
            self.values.append(v)
        self.valid_BT = torch.zeros((batch, width + GROW), dtype=torch.bool, device=mask_BT.device)
        self.valid_BT[:, :width] = mask_BT.bool()
        self.pos_B = mask_BT.sum(-1)  # the next position of each slot: prompts count real tokens only
        self.col = width  # the buffer column the next token's key and value go to
        self.slots = torch.arange(batch, device=mask_BT.device)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only running rows `idx` (indices into the current running rows)."""
        self.slots = self.slots[idx]
        if len(self.slots) < COMPACT_BELOW * len(self.pos_B):
            s = self.slots
            self.keys = [k[s] for k in self.keys]
            self.values = [v[s] for v in self.values]
            self.valid_BT, self.pos_B = self.valid_BT[s], self.pos_B[s]
            self.slots = torch.arange(len(s), device=s.device)

    def _grow(self) -> None:
        self.keys = [torch.cat([k, k.new_empty((*k.shape[:2], GROW, k.shape[3]))], dim=2) for k in self.keys]
        self.values = [torch.cat([v, v.new_empty((*v.shape[:2], GROW, v.shape[3]))], dim=2) for v in self.values]
        self.valid_BT = torch.cat([self.valid_BT, self.valid_BT.new_zeros((len(self.valid_BT), GROW))], dim=1)

    def step(self, tok_R: torch.Tensor) -> torch.Tensor:
        """Feed one token per running row; return the next-token logits of the running rows."""
        if self.col == self.valid_BT.shape[1]:
            self._grow()
        col, batch = self.col, len(self.pos_B)
        self.valid_BT[self.slots, col] = True
        model = self.model.model
        embedded_R1H = model.embed_tokens(tok_R[:, None])
        if len(tok_R) == batch:
            h_B1H = embedded_R1H
        else:  # finished slots still in the buffers run on zeros; their outputs are never read
            h_B1H = embedded_R1H.new_zeros((batch, *embedded_R1H.shape[1:]))
            h_B1H[self.slots] = embedded_R1H
        cos, sin = model.rotary_emb(h_B1H, self.pos_B[:, None])  # _B1D each
        cos, sin = cos[:, None], sin[:, None]  # _B11D: broadcast over heads
        group = self.n_heads // self.n_kv
        # blocked columns get -inf before the softmax; a finished slot's row keeps its prompt
        # columns, so its softmax stays finite
        neg_B11T = torch.zeros(self.valid_BT[:, : col + 1].shape, dtype=h_B1H.dtype).masked_fill_(
            ~self.valid_BT[:, : col + 1], float("-inf")
        )[:, None, None]
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        for i, layer in enumerate(model.layers):
            x_BH = layer.input_layernorm(h_B1H)[:, 0]
            qkv = x_BH @ self.weights.qkv[i]
            if self.weights.qkv_bias[i] is not None:
                qkv += self.weights.qkv_bias[i]
            q = qkv[:, :q_dim].view(batch, self.n_kv, group, self.head_dim)
            k = qkv[:, q_dim : q_dim + kv_dim].view(batch, self.n_kv, 1, self.head_dim)
            v = qkv[:, q_dim + kv_dim :].view(batch, self.n_kv, 1, self.head_dim)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            self.keys[i][:, :, col : col + 1] = k
            self.values[i][:, :, col : col + 1] = v
            scores = q @ self.keys[i][:, :, : col + 1].transpose(-1, -2)  # _B,kv,group,T
            probs = (scores * self.scale + neg_B11T).softmax(-1)
            attn_BH = (probs @ self.values[i][:, :, : col + 1]).reshape(batch, q_dim)
            h_B1H = h_B1H + (attn_BH @ self.weights.o[i])[:, None]
            x_BH = layer.post_attention_layernorm(h_B1H)[:, 0]
            gate, up = (x_BH @ self.weights.gate_up[i]).chunk(2, dim=-1)
            h_B1H = h_B1H + ((layer.mlp.act_fn(gate) * up) @ self.weights.down[i])[:, None]
        self.col += 1
        self.pos_B += 1
        return self.model.lm_head(model.norm(h_B1H[self.slots]))[:, -1]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
