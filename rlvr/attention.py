"""Attention in float32 for bfloat16 and float16 models on a CPU, where that is faster.

PyTorch's CPU FlashAttention kernel runs bf16 inputs 2-3× slower than the same inputs in fp32
(forward and backward, the shapes a learner's update and a prefill give it: 1.5 against 4.9 ms
for 3 rows of 58 queries over 112 keys, 9 heads of 64, on a Zen 4 EPYC; docs/LOG.md, session
18). So on a CPU where that is measured, a bf16 or float16 model's attention runs on float32
copies of its queries, keys and values, and its output is rounded back to the model's dtype:
bf16 updates of the bundled model 1.05-1.10× faster.

The numbers stay the model's to its dtype's rounding: a 16-bit number is a float32 number exactly,
both kernels sum in float32, and the bf16 kernel also rounds the attention weights to bf16
before it weighs the values, which the float32 one does not. Queries of one token (a decode step
of the Hugging Face decoder) keep the model's dtype: there the keys and values read are the whole
cache, which a copy would double.

It is an attention function of transformers' own registry (`AttentionInterface`), "sdpa_fp32",
that `load_model` sets (`widen_attention`) where the model's is SDPA; the mask is SDPA's. It is not
saved with the model (transformers keeps the attention choice out of `config.json`).
`RLVR_WIDE_ATTENTION=0` keeps the model's own attention, `=1` widens without measuring.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlvr.models import cpu_signature, measured, remember

WIDE = "sdpa_fp32"
SPEEDUP = 1.15
"""Widen where float32 attention runs at least this much faster than the model's dtype (the
copies cost memory: the float32 queries, keys and values a backward keeps)."""


def wide_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention on float32 copies of 16-bit queries, keys and values (queries
    of more than one token), the output in the queries' dtype."""
    dtype = query.dtype
    if dtype not in (torch.bfloat16, torch.float16) or query.shape[2] == 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


AttentionInterface.register(WIDE, wide_sdpa)
AttentionMaskInterface.register(WIDE, sdpa_mask)


def is_sdpa(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention is SDPA's, widened or not: it takes a boolean mask as it is."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", WIDE)


def widen_attention(model: PreTrainedModel) -> bool:
    """Run `model`'s attention in float32 (`wide_sdpa`) where that pays: a bf16 or float16 model on
    a CPU, with SDPA attention, on a CPU where float32 attention was measured faster
    (`wide_speedup`). Returns whether it did."""
    setting = os.environ.get("RLVR_WIDE_ATTENTION", "")
    if setting == "0" or getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float16):
        return False
    if setting != "1" and wide_speedup(model.dtype) < SPEEDUP:
        return False
    model.set_attn_implementation(WIDE)
    return True


def wide_speedup(dtype: torch.dtype) -> float:
    """How much faster attention's forward and backward run on float32 copies than in `dtype`,
    on this CPU: measured once per CPU, torch version and dtype (~0.1 s), and kept in
    $RLVR_CACHE/attention.json."""
    key = f"{cpu_signature()}|torch {torch.__version__}|{dtype}"
    known = measured("attention.json", key)
    if isinstance(known, (int, float)):
        return float(known)
    speedup = round(_measure(dtype), 3)
    remember("attention.json", key, speedup)
    return speedup


def _measure(dtype: torch.dtype, reps: int = 3) -> float:
    """Best-of-`reps` time of one attention forward and backward in `dtype`, over the same in
    float32 copies (the copies' own cost included): 4 rows of 64 queries over 128 keys, 9 heads
    of 64, a causal boolean mask (a learner's packed rows)."""
    generator = torch.Generator().manual_seed(0)
    shape = (4, 9, 64, 64)
    q, k, v = (torch.randn(shape if i == 0 else (4, 9, 128, 64), generator=generator).to(dtype) for i in range(3))
    mask = torch.ones(4, 1, 64, 128, dtype=torch.bool).tril(64)
    grad = torch.randn(shape, generator=generator).to(dtype)

    def run(wide: bool) -> float:
        best = float("inf")
        for _ in range(reps + 1):  # the first warms up
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            start = time.perf_counter()
            args = [t.float() for t in leaves] if wide else leaves
            out = F.scaled_dot_product_attention(*args, attn_mask=mask)
            out.to(dtype).backward(grad)
            best = min(best, time.perf_counter() - start)
        return best

    return run(False) / run(True)
