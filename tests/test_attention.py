"""rlvr.attention: a 16-bit model's attention on float32 copies, where that is faster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlvr import attention
from rlvr.attention import WIDE, wide_keys, wide_sdpa, widen_attention
from rlvr.models import load_model
from rlvr.train.logprobs import packs_completions
from tests.tiny import make_tiny_model


def _attention_inputs(queries: int, keys: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """The tiny model's shapes: 4 query heads over 2 key/value heads of 8; values around ±2."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, queries, 8, generator=generator) * 2
    k = torch.randn(2, 2, keys, 8, generator=generator) * 2
    v = torch.randn(2, 2, keys, 8, generator=generator) * 2
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _exact(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention in float64 on the same (16-bit) numbers, as [batch, queries, heads, dim]."""
    q, k, v = q.double(), k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


@pytest.fixture
def widened(monkeypatch: pytest.MonkeyPatch) -> dict[torch.dtype, float]:
    """`wide_sdpa` widening 16-bit attention at up to 32 keys."""
    limits = {torch.bfloat16: 32, torch.float16: 32}
    monkeypatch.setattr(attention, "_WIDE_KEYS", limits)
    return limits


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wide_attention_is_the_exact_value_rounded_once(dtype: torch.dtype, widened: object) -> None:
    """The float32 kernel's result, rounded once to the model's dtype: within half a unit in the
    last place of the exact value (at most 2^-8 relative in bf16, 2^-11 in float16) plus
    float32's summation error, which for a weighted mean of 16 values is ~16 · 2^-24 of their
    largest (bounded here by 1e-5 of it). The 16-bit kernel itself, which rounds the attention weights
    too, misses this bound by 4-12× on these inputs."""
    module = make_tiny_model().model.layers[0].self_attn
    q, k, v = _attention_inputs(16, 16, dtype)
    out, _ = wide_sdpa(module, q, k, v, None)
    assert out.dtype == dtype and out.shape == (2, 16, 4, 8)
    exact = _exact(q, k, v)
    half_ulp = torch.finfo(dtype).eps / 2
    assert ((out.double() - exact).abs() <= half_ulp * exact.abs() + 1e-5 * v.abs().max().double()).all()


def test_one_token_queries_and_long_keys_keep_the_models_own_kernel(widened: object) -> None:
    """A decode step's query (one token) over a long cache: no float32 copy of the cache; and
    more keys than the measured limit: the same bits as transformers' SDPA either way. Within
    the limit the bits differ (the widening is on)."""
    module = make_tiny_model().model.layers[0].self_attn
    for queries, keys, same in ((1, 20, True), (33, 33, True), (32, 32, False)):
        q, k, v = _attention_inputs(queries, keys, torch.bfloat16)
        mine, _ = wide_sdpa(module, q, k, v, None)
        theirs, _ = sdpa_attention_forward(module, q, k, v, None)
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs) is same


def test_load_model_widens_16_bit_models_where_set_and_never_saves_it(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "1")
    model = load_model(str(tiny_dir), "bfloat16")
    assert model.config._attn_implementation == WIDE and attention._WIDE_KEYS[torch.bfloat16] == float("inf")
    assert packs_completions(model)  # it takes the learner's boolean masks as SDPA does
    assert load_model(str(tiny_dir), "float32").config._attn_implementation == "sdpa"  # fp32 has nothing to widen
    model.save_pretrained(tmp_path / "saved")
    assert WIDE not in (tmp_path / "saved" / "config.json").read_text()
    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "0")
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == "sdpa"


def test_a_widened_models_gradients_are_bf16_gradients(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss gradient of a bf16 model with widened attention, against float64's: each bf16
    rounding along the two layers' forward and backward is up to 2^-8 relative, and a few dozen
    of them, of either sign, add up like a random walk (√n · 2^-8: ~0.02-0.03 of the gradient's
    norm; 0.033 measured), well within 2^-4. Attention without
    its causal mask (a wrong widening) is off by more than half of it (1.3 measured)."""
    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "1")
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    ids = torch.randint(3, 259, (2, 24), generator=torch.Generator().manual_seed(1))

    def gradient(model: torch.nn.Module) -> torch.Tensor:
        model.train()
        model(input_ids=ids, labels=ids).loss.float().backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    exact = gradient(make_tiny_model(dtype=torch.float64))  # the folder's weights
    wide_model = load_model(str(tiny_dir), "bfloat16")
    assert wide_model.config._attn_implementation == WIDE
    wide = gradient(wide_model)
    assert (wide - exact).norm() <= 2**-4 * exact.norm()

    def unmasked(module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: object,
                 **kwargs: object) -> tuple[torch.Tensor, None]:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float().repeat_interleave(2, 1), v.float().repeat_interleave(2, 1))
        return out.to(q.dtype).transpose(1, 2), None

    from transformers import AttentionInterface

    AttentionInterface.register(WIDE, unmasked)  # type: ignore[arg-type]
    try:
        broken = gradient(load_model(str(tiny_dir), "bfloat16"))
    finally:
        AttentionInterface.register(WIDE, wide_sdpa)
    assert (broken - exact).norm() > 0.5 * exact.norm()


def test_the_measurement_is_made_once_per_cpu_and_decides(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The longest of the measured lengths that all pay (from the shortest up) is kept per CPU
    and sets the limit; a CPU where none pays keeps the model's own attention."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RLVR_WIDE_ATTENTION", raising=False)
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    speedups = {64: 1.6, 128: 1.4, 192: 1.1, 256: 1.3, 384: 1.3, 512: 1.3}  # longer pays, but 192 does not
    calls = []
    monkeypatch.setattr(attention, "_measure", lambda dtype, keys: calls.append(keys) or speedups[keys])
    assert wide_keys(torch.bfloat16) == wide_keys(torch.bfloat16) == 128 and calls == [64, 128, 192]
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == WIDE
    assert attention._WIDE_KEYS == {torch.bfloat16: 128}
    cached = tmp_path / "cache" / "attention.json"
    cached.write_text(json.dumps({key: 0 for key in json.loads(cached.read_text())}))  # paid at no length
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == "sdpa"
    assert calls == [64, 128, 192]


def test_a_process_follows_the_limits_it_is_given(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The limit is measured per thread count, so a Ray worker on one thread would widen other
    lengths than its two-thread driver and sample other bf16 numbers: workers follow the
    driver's limits (`attention_limits`) without measuring, 0 (not widened) included."""
    monkeypatch.delenv("RLVR_WIDE_ATTENTION", raising=False)
    for name in ("_WIDE_KEYS", "_DECIDED", "_FOLLOWED"):
        monkeypatch.setattr(attention, name, {})
    monkeypatch.setattr(attention, "wide_keys", lambda dtype: 128)
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == WIDE
    assert attention.attention_limits() == {torch.bfloat16: 128}

    def unmeasured(dtype: torch.dtype) -> int:
        raise AssertionError("a process that follows another's limits measures nothing")

    monkeypatch.setattr(attention, "wide_keys", unmeasured)
    attention.follow_attention_limits({torch.bfloat16: 256})
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == WIDE
    assert attention._WIDE_KEYS[torch.bfloat16] == 256
    attention.follow_attention_limits({torch.bfloat16: 0})
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == "sdpa"
    assert attention.attention_limits() == {torch.bfloat16: 0}


def test_the_measurement_itself() -> None:
    """A real measurement: a positive, finite ratio (which way it goes depends on the CPU)."""
    assert 0 < attention._measure(torch.bfloat16, 64, reps=1) < float("inf")


def test_models_on_no_cpu_or_other_attention_are_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "1")
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    eager = make_tiny_model(dtype=torch.bfloat16)
    eager.set_attn_implementation("eager")
    assert not widen_attention(eager) and eager.config._attn_implementation == "eager"
    assert widen_attention(make_tiny_model(dtype=torch.bfloat16))


def test_a_mask_of_numbers_is_widened_with_the_queries(widened: object) -> None:
    """A caller's additive mask in the model's dtype (SDPA refuses one whose dtype is not the
    queries'): copied to float32 too, and the same bound as the causal call."""
    module = make_tiny_model().model.layers[0].self_attn
    q, k, v = _attention_inputs(16, 16, torch.bfloat16)
    future = torch.ones(16, 16, dtype=torch.bool).triu(1)
    mask = torch.zeros(2, 1, 16, 16, dtype=torch.bfloat16).masked_fill(future, float("-inf"))
    out, _ = wide_sdpa(module, q, k, v, mask)
    exact = _exact(q, k, v)
    assert ((out.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * v.abs().max().double()).all()


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a_model_loads_under_no_grad_and_a_failed_probe_widens_nothing(
        mode: object, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs a backward whatever mode the caller is in; and a probe that fails leaves
    the model's own attention (and caches nothing), it never fails the load."""
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RLVR_WIDE_ATTENTION", raising=False)
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    with mode():  # type: ignore[operator]
        load_model(str(tiny_dir), "bfloat16")
    assert isinstance(next(iter(json.loads((tmp_path / "cache" / "attention.json").read_text()).values())), int)

    def broken(dtype: torch.dtype, keys: int) -> float:
        raise RuntimeError("no")

    (tmp_path / "cache" / "attention.json").unlink()
    monkeypatch.setattr(attention, "_measure", broken)
    assert load_model(str(tiny_dir), "bfloat16").config._attn_implementation == "sdpa"
    assert not (tmp_path / "cache" / "attention.json").exists()


def test_a_widened_model_cast_to_float32_or_on_no_cpu_runs_plain_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "1")
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    model = make_tiny_model(dtype=torch.bfloat16)
    assert widen_attention(model)
    model.to(torch.float32)  # the limit is per dtype: float32 has none
    ids = torch.randint(3, 259, (2, 12), generator=torch.Generator().manual_seed(2))
    plain = make_tiny_model(dtype=torch.bfloat16).to(torch.float32)  # the same rounded weights, SDPA
    assert plain.config._attn_implementation == "sdpa" and torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert not widen_attention(make_tiny_model(dtype=torch.bfloat16).to("meta"))
    q, k, v = (t.to("meta") for t in _attention_inputs(8, 8, torch.bfloat16))
    out, _ = wide_sdpa(plain.model.layers[0].self_attn, q, k, v, None)
    assert out.dtype == torch.bfloat16  # not on a CPU: the model's own kernel


def test_a_bf16_engine_beside_an_fp32_learner_is_widened(
        tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own bf16 copy of an fp32 learner's model widens its prefill's attention; the
    learner, in fp32, keeps SDPA."""
    from rlvr.config import load_config
    from rlvr.train.setup import setup
    from tests.test_train import overrides

    monkeypatch.setenv("RLVR_WIDE_ATTENTION", "1")
    monkeypatch.setattr(attention, "_WIDE_KEYS", {})
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "mixed"), 'train.precision="fp32"',
                             'engine.dtype="bfloat16"'])
    run = setup(cfg, tmp_path / "mixed")
    assert run.learner.model.config._attn_implementation == "sdpa"
    assert run.engine.model.dtype == torch.bfloat16 and run.engine.model.config._attn_implementation == WIDE
