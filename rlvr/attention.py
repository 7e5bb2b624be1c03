"""Attention in float32 for bfloat16 and float16 models on a CPU, where that is faster.

PyTorch's CPU FlashAttention kernel runs short bf16 sequences up to 2.6× slower than the same
numbers in fp32 (forward and backward; in 16 bits it has a fixed cost per block), and long ones
as fast or faster. On a Zen 4 EPYC, with the copies' cost counted, float32 ran 1.5-2.7× faster
at 64 keys, 1.3-1.8× at 128, 1.25-1.35× at 192, 1.1-1.2× at 256, 0.95-1.1× at 384 and
0.9-1.0× at 512 (docs/LOG.md, session 18). A GRPO update's attention is mostly short: a group's
prompt once, then its completions packed in rows about as long as its longest
(`rlvr.train.logprobs.completion_lanes`). So on a CPU where it pays, a bf16 or float16 model's
attention over up to `wide_keys` keys runs on float32 copies of its queries, keys and values,
its output rounded back to the model's dtype: the bundled model's bf16 GRPO updates ran
1.08-1.15× faster.

The numbers stay the model's to its dtype's rounding: a 16-bit number is a float32 number exactly,
and both kernels sum in float32; the float32 one rounds only its output, the 16-bit one also
rounds in between and lands further from the exact value (4-12× as far on tests/test_attention.py's
inputs). Queries of one token (a decode step of the Hugging Face decoder) keep the model's kernel:
there the keys and values read are the whole cache, which a copy would double.

It is an attention function of transformers' own registry (`AttentionInterface`), "sdpa_fp32",
that `load_model` sets (`widen_attention`) where the model's is SDPA; the mask is SDPA's. It is not
saved with the model (transformers keeps the attention choice out of `config.json`).
`RLVR_WIDE_ATTENTION=0` keeps the model's own attention; `=1` widens at every length, unmeasured.

"sdpa_float64" (`exact_sdpa`, set by `exact_attention`) is attention for matched numerics
(rlvr.rollout.matched): the forward on float64 copies, its output rounded once to the model's
dtype, so that the learner's whole-sequence pass and the decoder's one-token steps, which sum
their keys in different orders, still give the same bits (a float64 sum's error, ~1e-16 of it,
almost never moves a bf16 rounding, ~4e-3 apart); the backward recomputes in float32.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rlvr.models import cpu_signature, measured, remember

log = logging.getLogger(__name__)

WIDE = "sdpa_fp32"
SPEEDUP = 1.2
"""Widen a length where float32 attention runs at least this much faster than the model's dtype:
the copies cost memory (a backward keeps the float32 queries, keys and values), e.g. 0.24 GB more
for a 16 × 256 update of the bundled model in micro-batches of 8 rows, where widening 256 keys
(measured 1.10-1.22× alone) gained nothing in the whole update."""
LENGTHS = (64, 128, 192, 256, 384, 512)
"""The key counts `_measure` times, each with half as many queries and as many."""
_WIDE_KEYS: dict[torch.dtype, float] = {}
"""Per dtype, the most keys an attention call is widened at (`widen_attention` sets it)."""
_DECIDED: dict[torch.dtype, float] = {}
"""Per dtype, the limit `widen_attention` chose in this process (0: not widened)."""
_FOLLOWED: dict[torch.dtype, float] = {}
"""Per dtype, another process's limits this one follows instead of its own (`follow_attention_limits`)."""


def wide_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' SDPA attention, on float32 copies of 16-bit queries, keys and values where
    there are at most `_WIDE_KEYS` keys and more than one query, on a CPU (a mask of numbers,
    which SDPA wants in the queries' dtype, copied too); the output in the queries' dtype."""
    dtype = query.dtype
    if query.shape[2] == 1 or key.shape[2] > _WIDE_KEYS.get(dtype, 0) or query.device.type != "cpu":
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


AttentionInterface.register(WIDE, wide_sdpa)
AttentionMaskInterface.register(WIDE, sdpa_mask)


EXACT = "sdpa_float64"


class _ExactSDPA(torch.autograd.Function):
    """transformers' SDPA attention computed on float64 copies, the output rounded once to the
    inputs' dtype; the backward is float32 SDPA's, recomputed (the forward keeps only its inputs)."""

    @staticmethod
    def forward(ctx: Any, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,  # type: ignore[override]
                value: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]) -> torch.Tensor:
        ctx.module, ctx.kwargs = module, kwargs
        ctx.save_for_backward(query, key, value, attention_mask)
        mask = attention_mask.double() if attention_mask is not None and attention_mask.is_floating_point() \
            else attention_mask
        out, _ = sdpa_attention_forward(module, query.double(), key.double(), value.double(), mask, **kwargs)
        return out.to(query.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        query, key, value, attention_mask = ctx.saved_tensors
        mask = attention_mask.float() if attention_mask is not None and attention_mask.is_floating_point() \
            else attention_mask
        inputs = (query, key, value)
        needed = ctx.needs_input_grad[1:4]
        with torch.enable_grad():
            leaves = [t.detach().float().requires_grad_(need) for t, need in zip(inputs, needed)]
            out, _ = sdpa_attention_forward(ctx.module, leaves[0], leaves[1], leaves[2], mask, **ctx.kwargs)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad.float()) if wanted else ())
        return (None, *(next(grads).to(t.dtype) if need else None for t, need in zip(inputs, needed)), None, None)


def exact_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' SDPA attention with its forward on float64 copies (`_ExactSDPA`)."""
    return _ExactSDPA.apply(module, query, key, value, attention_mask, kwargs), None


AttentionInterface.register(EXACT, exact_sdpa)
AttentionMaskInterface.register(EXACT, sdpa_mask)


def exact_attention(model: PreTrainedModel) -> bool:
    """Run `model`'s attention in float64 (`exact_sdpa`) where it is SDPA's (widened or not);
    returns whether it does."""
    if not is_sdpa(model):
        return False
    model.set_attn_implementation(EXACT)
    return bool(model.config._attn_implementation == EXACT)


def is_sdpa(model: PreTrainedModel) -> bool:
    """Whether `model`'s attention is SDPA's, widened or exact or neither: it takes a boolean mask as it is."""
    return getattr(model.config, "_attn_implementation", None) in ("sdpa", WIDE, EXACT)


def widen_attention(model: PreTrainedModel) -> bool:
    """Run `model`'s attention in float32 (`wide_sdpa`) where that pays: a bf16 or float16 model on
    a CPU, with SDPA attention, on a CPU where float32 attention was measured faster up to some
    number of keys (`wide_keys`). Returns whether it did.

    The limit is the process's, per dtype (`_WIDE_KEYS`): every widened model of a dtype uses
    the one measured for this CPU, or none with `RLVR_WIDE_ATTENTION=1`, whichever load set it
    last; or the limit of the process it follows (`follow_attention_limits`)."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if model.device.type != "cpu" or model.dtype not in (torch.bfloat16, torch.float16):
        return False
    setting = os.environ.get("RLVR_WIDE_ATTENTION", "")
    if model.dtype in _FOLLOWED:
        keys = _FOLLOWED[model.dtype]
    else:
        keys = 0 if setting == "0" else float("inf") if setting == "1" else wide_keys(model.dtype)
    _DECIDED[model.dtype] = keys
    if not keys:
        return False
    _WIDE_KEYS[model.dtype] = keys
    model.set_attn_implementation(WIDE)  # a class that cannot change its attention only warns
    return bool(model.config._attn_implementation == WIDE)


def attention_limits() -> dict[torch.dtype, float]:
    """The limits this process chose, per dtype, for processes that must compute its numbers."""
    return dict(_DECIDED)


def follow_attention_limits(limits: dict[torch.dtype, float]) -> None:
    """Use ``limits`` (another process's `attention_limits`) for the models loaded from now on,
    instead of measuring this process's own. The limit is measured per thread count, so a Ray
    rollout worker or learner rank on fewer threads than the driver would widen other lengths,
    and sample or train other numbers in bf16 (rlvr.scaleout); and a resumed run would compute other
    numbers than its first invocation where this machine measured again (rlvr.rollout.numerics).
    They replace any limits followed before; {} returns to this process's own."""
    _FOLLOWED.clear()
    _FOLLOWED.update(limits)


def wide_keys(dtype: torch.dtype) -> int:
    """Up to how many keys attention runs at least `SPEEDUP` times faster on float32 copies than
    in `dtype` on this CPU (0: at none of `LENGTHS`): measured once per CPU, torch version, thread
    count, dtype and rule (~0.5 s on a Zen 4 EPYC), and kept in $RLVR_CACHE/attention.json. A
    measurement that fails (it should not) widens nothing, with a warning: a speed probe never
    stops a model from loading."""
    key = (f"{cpu_signature()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{dtype}"
           f"|x{SPEEDUP} at {','.join(map(str, LENGTHS))} keys")
    known = measured("attention.json", key)
    if isinstance(known, int):
        return known
    keys = 0
    try:
        # the probe runs a backward, whatever the caller's mode (a model loaded under no_grad)
        with torch.inference_mode(False), torch.enable_grad():
            for length in LENGTHS:  # the longest of the lengths that all pay, from the shortest up
                speedup = _measure(dtype, length)
                log.info("attention over %d keys: %.2fx faster on float32 copies than in %s", length, speedup, dtype)
                if speedup < SPEEDUP:
                    break
                keys = length
    except Exception as error:  # noqa: BLE001 - any failure of a speed probe
        log.warning("measuring attention in float32 against %s failed (%s): the model keeps its own", dtype, error)
        return 0
    remember("attention.json", key, keys)
    return keys


def _measure(dtype: torch.dtype, keys: int, reps: int = 3) -> float:
    """How much faster attention's forward and backward run on float32 copies than in `dtype`
    (the copies' own cost included; best of `reps` each): 9 heads of 64, `keys` keys, once with
    as many queries (a prompt or a whole row) and once with half as many (a row of completions
    after a shared prompt), causal, 512 keys over the rows (a GRPO update's micro-batch of
    completions holds a few hundred)."""
    generator = torch.Generator().manual_seed(0)
    rows = max(1, 512 // keys)

    def run(queries: int, wide: bool) -> float:
        q, grad = (torch.randn(rows, 9, queries, 64, generator=generator).to(dtype) for _ in range(2))
        k, v = (torch.randn(rows, 9, keys, 64, generator=generator).to(dtype) for _ in range(2))
        mask = torch.ones(rows, 1, queries, keys, dtype=torch.bool).tril(keys - queries)
        best = float("inf")
        for _ in range(reps + 1):  # the first warms up
            leaves = [t.requires_grad_() for t in (q.detach(), k.detach(), v.detach())]
            start = time.perf_counter()
            qi, ki, vi = (t.float() for t in leaves) if wide else leaves
            F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask).to(dtype).backward(grad)
            best = min(best, time.perf_counter() - start)
        return best

    own = run(keys // 2, False) + run(keys, False)
    return own / (run(keys // 2, True) + run(keys, True))
