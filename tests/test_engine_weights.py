"""`engine.dtype = "float16"`: the static decoder on float16 copies of the weights (fbgemm's CPU kernel).

The products are checked against the float16-rounded weight in float64, and the wiring (fused
q/k/v, gate/up, the output head) against a full forward pass of a model whose weights are
already float16 values, where the copies are exact and only summation order differs. A run shows
the mismatch the format brings: none for the model's own weights, some for float16.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.config import load_config
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.static_decode import Dense, Float16, FusedWeights, StaticDecoder
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
    cache, _, mask_PT, _ = engine._prefill(prompts)
    weights = FusedWeights(model, "float16")
    assert isinstance(weights.qkv[0], Float16) and isinstance(weights.head, Float16)
    n = 2
    decoder = StaticDecoder(model, weights, cache, mask_PT, n)
    tokens: list[list[int]] = [[] for _ in range(len(prompts) * n)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        tok = torch.randint(3, 259, (len(tokens),), generator=gen)
        for row, t in zip(tokens, tok.tolist()):
            row.append(t)
        logits = decoder.step(tok)
        for r, row_logits in enumerate(logits):
            ids = torch.tensor([prompts[r // n] + tokens[r]])
            torch.testing.assert_close(row_logits, model(input_ids=ids).logits[0, -1], atol=1e-4, rtol=0)
    fp32 = FusedWeights(model)
    assert isinstance(fp32.qkv[0], Dense) and isinstance(fp32.head, Dense)
    assert fp32.head.w_oi is not None and fp32.head.w_oi.data_ptr() == model.lm_head.weight.data_ptr()  # no copy
    assert FusedWeights(copy.deepcopy(model).bfloat16()).head is None  # bf16: the model's own head, no copy made


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_gives_the_product_for_every_row_count(dtype: torch.dtype) -> None:
    """`Dense` runs one row and several rows in different forms (fp32: `x @ W` on an [in, out]
    copy, then `(W xᵀ)ᵀ` on the weight itself): each is the product x Wᵀ up to summation order.
    Bound: fp32 accumulation of 64 terms, ≤ 64 · 2^-24 of Σ|x·w| (< 1e-5 of it); bf16 rounds the
    result to 8 bits (2^-8 of |y| ≤ Σ|x·w|). The [out, in] form reuses the weight's storage."""
    gen = torch.Generator().manual_seed(0)
    w_oi = (torch.randn(96, 64, generator=gen) * 0.05).to(dtype)
    bound = 1e-5 if dtype == torch.float32 else 2**-8
    for single_row in (True, False):
        dense = Dense(w_oi, single_row=single_row)
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
    else:  # not MKL's sgemm: the [in, out] copy only, as before
        assert head_like.w_oi is None and head_like.w_io is not None


def test_the_engine_refuses_what_the_formats_cannot_run(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast
) -> None:
    with pytest.raises(ValueError, match="static decoder"):
        EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="hf", weights="float16")
    with pytest.raises(ValueError, match="weights must be"):
        EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], weights="int8")
    with pytest.raises(ValueError, match="backend"):
        load_config(None, ['engine.backend="vllm"', 'engine.dtype="float16"'])


def test_a_run_logs_the_mismatch_float16_brings(tiny_dir: Path, tmp_path: Path) -> None:
    """Two GRPO steps (lr 1e-3) with the engine sharing the learner's fp32 weights, and two on
    float16 copies: the sampler/learner log-ratio is ~0 (summation order) for the first; the
    second's 11-bit weights move it to ~5e-4 here, at step 2 too, so the copies follow the
    learner's update (copies left stale after step 1 put step 2 at ~0.04, for both)."""
    mismatch = {}
    for fmt in ("float32", "float16"):
        cfg = load_config(None, overrides(tiny_dir, tmp_path, fmt, engine__dtype=f'"{fmt}"',
                                          engine__decoder='"static"', algo__offpolicy='"tis"') + FP32[:1])
        train(cfg, quiet=True)
        mismatch[fmt] = [row["mismatch_logratio_abs"] for row in read_metrics(tmp_path / fmt)]
    assert max(mismatch["float32"]) < 1e-4 < min(mismatch["float16"]), mismatch
    assert max(mismatch["float16"]) < 0.005, mismatch


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
