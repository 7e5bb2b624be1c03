"""Matched numerics (rlvr.rollout.matched): in bf16 the embedded engine's log-probs are the learner's.

Tolerance: with matching, the engine's and the learner's logits are the same bf16 numbers, and
what is left is the last step, the sampler's float32 `log_softmax` against the learner's float32
`logsumexp`: a few float32 roundings of numbers of the logits' size (|z| < 30 here, 2^-24 of it
~2e-6 each), so 1e-5. The fast engine's bf16 drift on the same model is 1e-3 to 1e-2.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlvr.attention import EXACT, exact_attention, exact_sdpa, is_sdpa
from rlvr.config import load_config
from rlvr.rollout import matched
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.forms import FORMS
from rlvr.rollout.matched import matched_plans, unmatched_reason
from rlvr.train.loop import train
from rlvr.train.logprobs import shared_prompt_logprobs
from rlvr.train.setup import _numerics
from rlvr.types import SamplingParams
from tests.test_train import overrides, read_metrics
from tests.tiny import EOS_ID, make_tiny_model, make_tiny_tokenizer

pytestmark = pytest.mark.dtype_independent  # every model here is pinned to bf16 (or fp32)

AFTER_ROUNDING = 1e-5
"""The most |engine − learner| a matched token's log-prob may show (the module docstring)."""


class _Attention(torch.nn.Module):
    num_key_value_groups, is_causal = 2, True


def _qkv(queries: int, keys: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [(2, 4, queries, 8), (2, 2, keys, 8), (2, 2, keys, 8)]
    return [(torch.randn(s, generator=gen) * 2).to(torch.bfloat16).requires_grad_() for s in shapes]


@pytest.mark.parametrize("masked", [False, True])
def test_exact_attention_is_float64_rounded_once_and_float32s_gradient(masked: bool) -> None:
    q, k, v = _qkv(6, 6)
    mask = torch.ones(2, 1, 6, 6, dtype=torch.bool).tril() if masked else None
    if mask is not None:
        mask[1, :, :, 0] = False  # a left pad in the second row (no query row is left empty)
        mask[1, :, 0, 0] = True
    out, _ = exact_sdpa(_Attention(), q, k, v, mask, scaling=8**-0.5)
    want, _ = sdpa_attention_forward(_Attention(), q.double(), k.double(), v.double(), mask, scaling=8**-0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32, _ = sdpa_attention_forward(_Attention(), *leaves, mask, scaling=8**-0.5)
    for g, w in zip(got, torch.autograd.grad(out32, leaves, grad.float())):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))


def _mismatch(numerics: str, decoder: str) -> torch.Tensor:
    """|engine − learner| of every sampled token's log-prob: three prompts of other lengths, four
    samples each, EOS on, so rows finish and the decoder compacts."""
    tokenizer, model = make_tiny_tokenizer(), make_tiny_model(dtype=torch.bfloat16).eval()
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[EOS_ID], seed=0, decoder=decoder,  # type: ignore[arg-type]
                            numerics=numerics)  # type: ignore[arg-type]
    prompts = [tokenizer.encode("hello there, how are you " * k) for k in (1, 3, 5)]
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=40, n=4))
    completions = [list(c.token_ids) for group in groups for c in group]
    sampled = torch.tensor([lp for group in groups for c in group for lp in c.logprobs], dtype=torch.float64)
    with torch.no_grad():
        learner, _ = shared_prompt_logprobs(model, prompts, completions, [i for i in range(3) for _ in range(4)], 0)
    assert len(sampled) > 100
    return (learner.double() - sampled).abs()


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_matched_engine_samples_with_the_learners_logprobs(decoder: str) -> None:
    model = make_tiny_model(dtype=torch.bfloat16)
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    exact, fast = _mismatch("matched", decoder), _mismatch("fast", decoder)
    assert float(exact.max()) < AFTER_ROUNDING
    assert float(fast.mean()) > 10 * AFTER_ROUNDING  # what matching removes: bf16's drift (measured 3e-3-1e-2)


def test_matched_sets_the_models_attention_and_its_plans_have_no_float16_form() -> None:
    model = make_tiny_model(dtype=torch.bfloat16)
    plans = matched_plans(model)
    if isinstance(plans, str):
        pytest.skip(f"matching is not available on this CPU: {plans}")
    assert not any(FORMS[name].in_fp16 for name in (*plans.layers, *plans.head))
    EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    assert model.config._attn_implementation == EXACT and is_sdpa(model)


def test_where_no_form_gives_the_learners_bits_matching_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matched, "_CHOSEN", {})
    off = {name: form._replace(run=lambda kept, x, run=form.run: run(kept, x) * (1 + 2**-6))
           for name, form in FORMS.items()}  # every form a bf16 step away from the learner's product
    monkeypatch.setattr(matched, "FORMS", off)
    model = make_tiny_model(dtype=torch.bfloat16)
    why = matched_plans(model)
    assert isinstance(why, str) and "no product form gives the learner's bits at 1 rows" in why
    with pytest.raises(ValueError, match="matched numerics cannot run here: no product form"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    assert model.config._attn_implementation != EXACT  # nothing changed on the way to the error


def test_where_only_one_row_rounds_otherwise_a_row_runs_as_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose one-row kernel rounds differently (oneDNN's bf16 1536→576 product on a Zen 5:
    13% of single rows): the probe must notice it on some row, and run one row as two there."""
    if isinstance(why := matched_plans(make_tiny_model(dtype=torch.bfloat16)), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    monkeypatch.setattr(matched, "_CHOSEN", {})
    off = {name: form if form.paired else
           form._replace(run=lambda kept, x, run=form.run: run(kept, x) * (1 + 2**-6) if len(x) == 1 else run(kept, x))
           for name, form in FORMS.items()}  # the paired forms keep the true kernels: they never run one row
    monkeypatch.setattr(matched, "FORMS", off)
    model = make_tiny_model(dtype=torch.bfloat16)
    plans = matched_plans(model)
    assert not isinstance(plans, str), plans
    assert off[plans.layers[0]].paired and off[plans.head[0]].paired
    assert not any(off[name].paired for name in (*plans.layers[1:], *plans.head[1:]))
    # the Hugging Face decoder runs the model's own one-row products: it cannot match there
    monkeypatch.setattr("rlvr.rollout.engine.FORMS", off)
    with pytest.raises(ValueError, match="a single row's product rounds otherwise"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], decoder="hf", numerics="matched")
    EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], decoder="static", numerics="matched")


def test_matching_is_for_16_bit_models_on_a_cpu() -> None:
    model = make_tiny_model()  # fp32
    assert "16-bit models" in (unmatched_reason(model) or "")
    with pytest.raises(ValueError, match="matched numerics cannot run here: the model is float32"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    eager = make_tiny_model(dtype=torch.bfloat16)
    eager.set_attn_implementation("eager")
    assert "attention is 'eager'" in (unmatched_reason(eager) or "") and not exact_attention(eager)


def test_auto_numerics_match_where_the_engine_shares_the_learners_model(tiny_dir: Path, tmp_path: Path) -> None:
    model = make_tiny_model(dtype=torch.bfloat16)
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")

    def cfg(*extra: str):  # type: ignore[no-untyped-def]
        return load_config(None, [*overrides(tiny_dir, tmp_path, "n"), *extra])

    assert _numerics(cfg(), model, shared=True) == "matched"
    assert _numerics(cfg('engine.numerics="fast"'), model, shared=True) == "fast"
    assert _numerics(cfg(), model, shared=False) == "fast"  # LoRA, or an engine in another dtype
    assert _numerics(cfg(), make_tiny_model(), shared=True) == "fast"  # fp32
    assert _numerics(cfg("dist.rollout_workers=1"), model, shared=True) == "fast"
    with pytest.raises(ValueError, match="learner's own model in this process"):
        _numerics(cfg('engine.numerics="matched"', "dist.learners=2"), model, shared=True)
    with pytest.raises(ValueError, match='"matched" cannot run here: the model is float32'):
        _numerics(cfg('engine.numerics="matched"'), make_tiny_model(), shared=True)


def test_a_bf16_run_logs_no_mismatch_with_matched_numerics(tiny_dir: Path, tmp_path: Path) -> None:
    """Two GRPO steps in bf16 (the engine on the learner's weights), "auto" numerics and "fast": the
    logged sampler/learner log-ratio is rounding with matching, at step 2 too (after an update),
    and bf16's drift without."""
    if isinstance(why := matched_plans(make_tiny_model(dtype=torch.bfloat16)), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    logged = {}
    for numerics in ("auto", "fast"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, numerics, sampling__max_new_tokens=24),
                                 'train.precision="bf16"', 'engine.dtype="bfloat16"',
                                 f'engine.numerics="{numerics}"']), quiet=True)
        logged[numerics] = read_metrics(tmp_path / numerics)
    for row in logged["auto"]:
        assert row["mismatch_logratio_abs"] < AFTER_ROUNDING and row["mismatch_outside_band"] == 0, row
    assert min(row["mismatch_logratio_abs"] for row in logged["fast"]) > 10 * AFTER_ROUNDING, logged["fast"]
