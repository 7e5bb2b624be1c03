"""`engine.dtype = "float16"` and `"int8"`: the static decoder on float16 copies of the weights
(fbgemm's CPU kernel) or weight-only int8 ones (PyTorch's `_weight_int8pack_mm`).

The products are checked against the rounded weight in float64, and the wiring (fused q/k/v,
gate/up, the output head) against a full forward pass of a model whose weights are already
values of the format, where the copies are exact and only summation order (and, for int8's
kernel, bf16 activations) differs. A run shows the mismatch each format brings: none for the
model's own weights, some for float16, more for int8.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.config import load_config
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.static_decode import (Dense, Float16, FusedWeights, Int8, StaticDecoder, bf16_packing_unavailable,
                                        packed_form)
from rlvr.train.loop import train
from tests.test_engine_contract import PROMPTS, encode
from tests.test_train import FP32, overrides, read_metrics
from tests.tiny import EOS_ID


def test_float16_weights_give_the_product_of_the_rounded_weight() -> None:
    """fp32 activations times the float16-rounded weight, accumulated in fp32: within fp32
    accumulation of 64 terms (≤ 64 · 2^-24 of Σ|x·w|, here < 1e-5 of it) of the float64 product
    with the rounded weight, and measurably apart from the product with the unrounded one."""
    gen = torch.Generator().manual_seed(0)
    w_oi, x = torch.randn(96, 64, generator=gen) * 0.05, torch.randn(5, 64, generator=gen)
    y = Float16(w_oi)(x).double()
    scale = (x.double().abs() @ w_oi.double().abs().T)  # Σ|x·w| per output
    rounded = x.double() @ w_oi.half().double().T
    assert ((y - rounded).abs() / scale).max() < 1e-5
    assert ((y - x.double() @ w_oi.double().T).abs() / scale).max() > 1e-5  # it did round the weight
    assert Float16(w_oi)(x.bfloat16()).dtype == torch.bfloat16  # a bf16 engine gets its own dtype back


@torch.no_grad()
def test_the_static_decoder_on_float16_weights_matches_a_full_forward(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    """On a model whose parameters are float16 values, the float16 copies are exact: every decode
    step's logits must equal a full forward pass over prompt + tokens (no cache, no padding) to
    fp32 summation order, 1e-4 as the model-weights test, so a projection fused or split in the
    wrong order, or an output head left out, fails."""
    model = copy.deepcopy(tiny_model)
    for p in model.parameters():
        p.copy_(p.half().float())
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static", weights="float16")
    weights = FusedWeights(model, "float16")
    assert isinstance(weights.qkv[0], Float16) and isinstance(weights.head, Float16)
    steps_against_a_full_forward(engine, weights, prompts, lambda full: 1e-4)
    fp32 = FusedWeights(model)
    assert isinstance(fp32.qkv[0], Dense) and isinstance(fp32.head, Dense)
    assert fp32.head.w_oi is not None and fp32.head.w_oi.data_ptr() == model.lm_head.weight.data_ptr()  # no copy
    bf16 = FusedWeights(copy.deepcopy(model).bfloat16())
    if packed_form(model.lm_head.weight.bfloat16()):  # a oneDNN-packed copy, as every projection
        assert isinstance(bf16.head, Dense) and bf16.head.packed is not None
    else:  # the model's own head, no copy made
        assert bf16.head is None


@pytest.mark.parametrize("dtype, packed", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_dense_gives_the_product_for_every_row_count(dtype: torch.dtype, packed: bool,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """`Dense` runs one row and several rows in different forms (fp32: `x @ W` on an [in, out]
    copy, then `(W xᵀ)ᵀ` on the weight itself; bf16: oneDNN's linear on a packed copy, or `x @ W`
    where PyTorch has no oneDNN): each is the product x Wᵀ up to summation order.
    Bound: fp32 accumulation of 64 terms, ≤ 64 · 2^-24 of Σ|x·w| (< 1e-5 of it); bf16 rounds the
    result to 8 bits (2^-8 of |y| ≤ Σ|x·w|). The [out, in] form reuses the weight's storage."""
    from rlvr.rollout import static_decode

    if packed and (why := bf16_packing_unavailable()):
        pytest.skip(why)
    if not packed:
        monkeypatch.setattr(static_decode, "packed_form", lambda weight: False)
    gen = torch.Generator().manual_seed(0)
    w_oi = (torch.randn(96, 64, generator=gen) * 0.05).to(dtype)
    bound = 1e-5 if dtype == torch.float32 else 2**-8
    for single_row in (True, False):
        dense = Dense(w_oi, single_row=single_row)
        assert (dense.packed is not None) == packed
        for rows in (1, 2, 3, 17):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            y = dense(x)
            assert y.shape == (rows, 96) and y.dtype == dtype and y.is_contiguous()
            exact = x.double() @ w_oi.double().T
            scale = x.double().abs() @ w_oi.double().abs().T
            assert ((y.double() - exact).abs() / scale).max() < bound, (single_row, rows)
    head_like = Dense(w_oi, single_row=False)
    if dtype == torch.float32:
        assert head_like.w_oi is not None and head_like.w_oi.data_ptr() == w_oi.data_ptr() and head_like.w_io is None
    elif packed:  # the packed copy only
        assert head_like.w_oi is None and head_like.w_io is None
    else:  # not MKL's sgemm: the [in, out] copy only
        assert head_like.w_oi is None and head_like.w_io is not None


def test_bf16_without_onednn_packing_runs_the_plain_product(monkeypatch: pytest.MonkeyPatch,
                                                            tiny_model: LlamaForCausalLM) -> None:
    """Where oneDNN cannot pack bf16 (no oneDNN; an AVX2-only CPU), the probe says why, and the
    decoder keeps the plain bf16 forms: an [in, out] copy per projection and the model's own
    output head (no extra copy of it)."""
    from rlvr.rollout import static_decode

    static_decode.bf16_packing_unavailable.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    try:
        assert static_decode.bf16_packing_unavailable() == "this PyTorch has no oneDNN"
        weights = FusedWeights(copy.deepcopy(tiny_model).bfloat16())
        assert isinstance(weights.qkv[0], Dense) and weights.qkv[0].packed is None and weights.qkv[0].w_io is not None
        assert weights.head is None
    finally:
        static_decode.bf16_packing_unavailable.cache_clear()


def test_the_engine_refuses_what_the_formats_cannot_run(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="static decoder"):
        EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="hf", weights="float16")
    with pytest.raises(ValueError, match="weights must be"):
        EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], weights="int4")
    for fmt in ("float16", "int8"):
        with pytest.raises(ValueError, match="backend"):
            load_config(None, ['engine.backend="vllm"', f'engine.dtype="{fmt}"'])
    # int8's kernel is vectorised for AVX-512 only: elsewhere it is refused, saying why
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    with pytest.raises(ValueError, match="AVX-512.*'AVX2'"):
        EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], weights="int8")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], weights="int8").weights == "int8"


def test_a_run_logs_the_mismatch_float16_and_int8_bring(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two GRPO steps (lr 1e-3) with the engine sharing the learner's fp32 weights, two on
    float16 copies and two on int8 ones: the sampler/learner log-ratio is ~0 (summation order)
    for the first; float16's 11-bit weights move it to ~5e-4 here, int8's (steps of 1/127 of a
    row's largest weight, and bf16 activations in the kernel) to ~0.012, at step 2 too, so the
    copies follow the learner's update (copies left stale after step 1 put step 2 at ~0.04)."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")  # slow on AVX2, but runs
    mismatch = {}
    for fmt in ("float32", "float16", "int8"):
        cfg = load_config(None, overrides(tiny_dir, tmp_path, fmt, engine__dtype=f'"{fmt}"',
                                          engine__decoder='"static"', algo__offpolicy='"tis"') + FP32[:1])
        train(cfg, quiet=True)
        mismatch[fmt] = [row["mismatch_logratio_abs"] for row in read_metrics(tmp_path / fmt)]
    assert max(mismatch["float32"]) < 1e-4 < min(mismatch["float16"]), mismatch
    assert max(mismatch["float16"]) < 0.005 < min(mismatch["int8"]), mismatch
    assert max(mismatch["int8"]) < 16 * 0.005, mismatch  # int8's step ≤ 2^-7 of a row's largest weight: 16× float16's 2^-11


def test_rollout_workers_decode_the_learners_dtype(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ray rollout worker with engine.dtype = "float16" holds the model in the dtype of the
    weights it is sent (the learner's), as the local engine shares the learner's model, not in
    what "auto" picks on its machine."""
    from rlvr.models import load_model
    from rlvr.scaleout.rollout import RolloutWorker

    monkeypatch.setenv("RLVR_AUTO_DTYPE", "bf16")
    state = load_model(str(tiny_dir), torch.float32).state_dict()
    worker = RolloutWorker(str(tiny_dir), state, 0, dtype="float16", max_batch_size=8, decoder="static",
                           eos_token_ids=[EOS_ID], threads=1)
    assert worker.engine.model.dtype == torch.float32 and worker.engine.weights == "float16"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_weights_give_the_product_of_the_quantized_weight(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Int8` stores q = round(w / s) per output row (s = max |w| / 127, itself rounded to bf16)
    and multiplies by q · s on both of its paths:
    - through PyTorch's kernel up to `KERNEL_ROWS` rows: activations rounded to bf16, the sum and
      its scaled result each rounded to bf16, so within 2 · 2^-9 of Σ|x·w| of the product of the
      rounded activations;
    - as a product on q in the model's dtype, scaled after, beyond: fp32 exact weight and fp32
      sums (≤ 1e-5 of Σ|x·w|); bf16 the same two roundings (2^-8).
    And it did quantize: a step s/2 at most from each weight (sd s/√12 ≈ max |w| / 440, ~1/150 of a
    typical weight here) is ~3× bf16's rounding of a result (2^-9), so averaged over the outputs
    the distance to the product with w itself is ≥ 2× that to q · s (seen 3.2-5.2×). The two
    paths on the same rows agree within the sum of their bounds."""
    gen = torch.Generator().manual_seed(0)
    w_oi = (torch.randn(96, 64, generator=gen) * 0.05).to(dtype)
    int8 = Int8(w_oi)
    assert int8.q.dtype == torch.int8 and int8.q.abs().amax(dim=1).eq(127).all()
    step = int8.scale.double()[:, None]
    dequantized = int8.q.double() * step
    assert ((dequantized - w_oi.double()).abs() <= step / 2 * 1.01).all()  # half a step; 1% for the bf16 scale
    for rows in (1, Int8.KERNEL_ROWS, Int8.KERNEL_ROWS + 1, 17):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        y = int8(x)
        assert y.shape == (rows, 96) and y.dtype == dtype
        kernel = rows <= Int8.KERNEL_ROWS
        fed = (x.bfloat16() if kernel else x).double()
        scale = x.double().abs() @ dequantized.abs().T
        bound = 2**-8 if kernel or dtype == torch.bfloat16 else 1e-5
        to_q = (y.double() - fed @ dequantized.T).abs() / scale
        to_w = (y.double() - fed @ w_oi.double().T).abs() / scale
        assert to_q.max() < bound, (rows, dtype)
        assert to_w.mean() > 2 * to_q.mean(), (rows, dtype)
    x = torch.randn(3, 64, generator=gen).to(dtype)
    through_kernel = int8(x).double()
    monkeypatch.setattr(Int8, "KERNEL_ROWS", 0)
    scale = x.double().abs() @ dequantized.abs().T
    assert ((int8(x).double() - through_kernel).abs() / scale).max() < 2**-8 + (2**-8 if dtype == torch.bfloat16 else 1e-5) + 2**-9


@torch.no_grad()
@pytest.mark.parametrize("kernel_rows", [0, 100])
def test_the_static_decoder_on_int8_weights_matches_a_full_forward(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast, kernel_rows: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a model whose every weight row is q · 2^-e with integers |q| ≤ 127 and one |q| = 127,
    the int8 copies are exact, so each decode step's logits must match a full forward pass: to
    fp32 summation order (1e-4) on the dequantized path (kernel_rows 0), and within the bf16
    rounding of the kernel path (kernel_rows 100): each product's result is off by ≤ 2^-8 of its
    scale, and seven products in series (three a layer, two layers, the head) add to first order
    ≤ 7 · 2^-8 < 3% of the logits' scale (seen: 1.4%), where a projection fused or split in the
    wrong order, or a head left out, moves them by O(1)."""
    monkeypatch.setattr(Int8, "KERNEL_ROWS", kernel_rows)
    model = copy.deepcopy(tiny_model)
    for name, p in model.named_parameters():
        if p.dim() == 2:  # projections and the (tied) embedding: rows of q · 2^-e
            live = p.abs().amax(dim=1) > 0  # the padding token's embedding row is zero, and stays so
            step = torch.exp2(torch.floor(torch.log2(p[live].abs().amax(dim=1) / 127)))[:, None]
            q = torch.round(p[live] / step).clamp(-127, 127)
            q[torch.arange(len(q)), q.abs().argmax(dim=1)] = 127.0
            p[live] = q * step
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    weights = FusedWeights(model, "int8")
    assert isinstance(weights.qkv[0], Int8) and isinstance(weights.head, Int8)
    for proj, source in ((weights.o[0], model.model.layers[0].self_attn.o_proj.weight), (weights.head, model.lm_head.weight)):
        assert isinstance(proj, Int8)
        torch.testing.assert_close(proj.q.float() * proj.scale.float()[:, None], source, atol=0, rtol=0)
    worst = steps_against_a_full_forward(
        engine, weights, prompts, lambda full: 1e-4 if kernel_rows == 0 else 0.03 * float(full.abs().max()))
    if kernel_rows:
        assert worst > 1e-4  # the kernel path ran, with its bf16 activations


def test_the_bf16_static_decoder_on_packed_weights_matches_a_full_forward(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    """A bf16 model's decoder runs every projection and the output head on oneDNN-packed copies
    of the same bf16 weights: each decode step's logits must match a full bf16 forward pass to
    bf16 rounding. Both sides round every product and norm to 8 bits, in other places and
    orders: ~10 roundings in series (two layers of three products and two norms, the final norm,
    the head) of ≤ 2^-8 each, on each side, suggest a difference of up to ~20 · 2^-8 ≈ 8% of
    the logits' scale: a margin, not a bound (each rounding is relative to its own product's
    Σ|x·w|, not to the largest logit; seen 3.5%). A projection fused or split in the wrong order,
    or a head left out, moves the logits by O(1): reversing the layers' q/k/v fails it."""
    if why := bf16_packing_unavailable():
        pytest.skip(why)
    model = copy.deepcopy(tiny_model).bfloat16()
    weights = FusedWeights(model)
    assert all(isinstance(p, Dense) and p.packed is not None for p in (*weights.qkv, *weights.down, weights.head))
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    worst = steps_against_a_full_forward(engine, weights, prompts, lambda full: 0.08 * float(full.abs().max()))
    assert worst > 0  # bf16 rounding differs somewhere: the comparison is not of a tensor with itself


def steps_against_a_full_forward(engine: EmbeddedEngine, weights: FusedWeights, prompts: list[list[int]],
                                 atol: Callable[[torch.Tensor], float]) -> float:
    """Six decode steps of two samples a prompt on `weights`, random tokens fed; each row's logits
    must equal a full forward pass over prompt + tokens (no cache, no padding) within
    `atol(full logits)`. Returns the largest difference seen."""
    model = engine.model
    cache, _, mask_PT, _ = engine._prefill(prompts)
    n = 2
    decoder = StaticDecoder(model, weights, cache, mask_PT, n)
    tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    gen = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(6):
        tok = torch.randint(3, 259, (len(tokens),), generator=gen)
        for row, t in zip(tokens, tok.tolist()):
            row.append(t)
        logits = decoder.step(tok)
        for r, row_logits in enumerate(logits):
            full = model(input_ids=torch.tensor([prompts[r // n] + tokens[r]])).logits[0, -1]
            torch.testing.assert_close(row_logits, full, atol=atol(full), rtol=0)
            worst = max(worst, float((row_logits - full).abs().max()))
    return worst
