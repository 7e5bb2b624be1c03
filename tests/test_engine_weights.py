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

from rlvr import models
from rlvr.config import load_config
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout import forms as forms_module
from rlvr.rollout import plans as plans_module
from rlvr.rollout import weights as weights_module
from rlvr.rollout import static_decode
from rlvr.rollout.static_decode import StaticDecoder
from rlvr.rollout.forms import FORMS, ROWS, bucket
from rlvr.rollout.plans import Plans, bf16_packing_unavailable, choose_plan, fixed_plan, packed_form, product_plans
from rlvr.rollout.weights import Dense, Float16, FusedWeights, Int8
from rlvr.train.loop import train
from rlvr.types import Completion, SamplingParams
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
    # a bias (Qwen2's q/k/v) is added to the fp32 sums: one fp32 rounding of results of size ~1 apart
    bias = torch.randn(96, generator=gen)
    assert torch.allclose(Float16(w_oi, bias)(x), Float16(w_oi)(x) + bias, rtol=0, atol=1e-6)


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
    assert isinstance(fp32.qkv[0], Dense) and isinstance(fp32.head, Dense) and fp32.plans is not None
    assert fp32.head.plan == fp32.plans.head and fp32.qkv[0].plan == fp32.plans.layers
    bf16 = FusedWeights(copy.deepcopy(model).bfloat16())  # measured plans, the head's too
    assert isinstance(bf16.head, Dense) and bf16.plans is not None and bf16.head.plan == bf16.plans.head


def available_forms(dtype: torch.dtype) -> list[str]:
    return [name for name in FORMS if forms_module.form_unavailable(name, dtype) is None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_form_gives_the_product_for_every_row_count(dtype: torch.dtype) -> None:
    """Each form `Dense` can run (`FORMS`: `nn.Linear`, `(W xᵀ)ᵀ`, `x @ W` on a copy, MKL's and
    oneDNN's packed products, bf16's float16 copy: those this PyTorch has) is the product x Wᵀ up
    to summation order, at every row count, and a plan mixing them runs each bucket in its own form.
    Bound: fp32 accumulation of 64 terms, ≤ 64 · 2^-24 of Σ|x·w| (< 1e-5 of it); bf16 rounds the
    result to 8 bits (2^-9 of |y| ≤ Σ|x·w|; "half" first to float16's 11, 2^-12 more)."""
    gen = torch.Generator().manual_seed(0)
    w_oi = (torch.randn(96, 64, generator=gen) * 0.05).to(dtype)
    bound = 1e-5 if dtype == torch.float32 else 2**-8
    forms = available_forms(dtype)
    assert {"linear", "left", "xw"} <= set(forms)
    assert ("half" in forms) == (dtype == torch.bfloat16)  # float16 copies round fp32 weights: refused
    mixed = tuple(forms[i % len(forms)] for i in range(len(ROWS)))
    for plan in [(name,) * len(ROWS) for name in forms] + [mixed]:
        dense = Dense(w_oi, plan)
        for rows in (1, 2, 3, 5, 17, 64, 100):
            x = torch.randn(rows, 64, generator=gen).to(dtype)
            y = dense(x)
            assert y.shape == (rows, 96) and y.dtype == dtype and y.is_contiguous()
            exact = x.double() @ w_oi.double().T
            scale = x.double().abs() @ w_oi.double().abs().T
            assert ((y.double() - exact).abs() / scale).max() < bound, (plan, rows)


def test_a_plan_runs_each_row_count_in_its_buckets_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows r run in the form of the smallest bucket ≥ r (the last for more), and a `Dense` keeps
    only what its plan's forms need: the model's weight itself for "linear" and "left"."""
    assert [bucket(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17, 33, 64, 65, 1000)] == [0, 1, 2, 2, 3, 3, 4, 4, 5, 6, 6, 6, 6]
    ran: list[str] = []
    for name in ("linear", "xw"):
        form = FORMS[name]
        monkeypatch.setitem(FORMS, name, form._replace(run=lambda k, x, b, run=form.run, name=name: ran.append(name) or run(k, x, b)))
    w = torch.randn(8, 4)
    dense = Dense(w, ("linear", "xw", "linear", "linear", "xw", "xw", "xw"))
    for rows in (1, 2, 3, 4, 9, 200):
        dense(torch.randn(rows, 4))
    assert ran == ["linear", "xw", "linear", "linear", "xw", "xw"]
    assert Dense(w, ("left",) * len(ROWS)).kept["left"].data_ptr() == w.data_ptr()  # no copy


def test_the_half_form_copies_only_a_weight_float16_holds() -> None:
    """bf16's values next to float16's largest (65504) are 65280, which float16 holds exactly, and
    65536, which it rounds to inf: a weight with 65536 anywhere (either sign), or a NaN, keeps the
    bf16 weight itself; one with ±65280 gets an exact float16 copy."""
    prepare = FORMS["half"].prepare
    for value, copied in ((65280.0, True), (-65280.0, True), (65536.0, False), (-65536.0, False),
                          (float("nan"), False), (float("inf"), False)):
        w = torch.full((4, 8), 0.5, dtype=torch.bfloat16)
        w[2, 3] = value
        kept = prepare(w)
        assert (kept.dtype == torch.float16) == copied, value
        if copied:
            assert torch.equal(kept.bfloat16(), w)
        else:
            assert kept is w


@torch.no_grad()
def test_a_lazy_form_runs_only_while_its_switch_is_on_and_is_made_of_the_weights_as_they_were(
    caplog: pytest.LogCaptureFixture
) -> None:
    """"half" (lazy) runs only while its switch is on, its rows running in the plan's nearest other
    form meanwhile; its copy is made at its first product. A `Dense` of a weight's parts (q, k, v)
    gives exactly what one of the joined weight gives. If the parts changed before the copy was
    made, the copy would hold other numbers than the eager ones: it is not made, with one
    warning for all the projections sharing the switch. A plan of lazy forms only has nothing to
    run meanwhile: made at once."""
    if why := forms_module.form_unavailable("half", torch.bfloat16):
        pytest.skip(why)
    gen = torch.Generator().manual_seed(0)
    parts = [(torch.randn(rows, 64, generator=gen) * 0.05).bfloat16() for rows in (32, 16, 16)]
    plan = ("half",) + ("linear",) * (len(ROWS) - 1)
    switch = weights_module.LazySwitch(on=False)
    dense, joined = Dense(parts, plan, switch), Dense(torch.cat(parts), plan)
    linear = Dense(torch.cat(parts), ("linear",) * len(ROWS))
    half = Dense(torch.cat(parts), ("half",) * len(ROWS))
    assert set(dense.kept) == {"linear"} and set(half.kept) == {"half"}
    x1, x3 = torch.randn(1, 64, generator=gen).bfloat16(), torch.randn(3, 64, generator=gen).bfloat16()
    assert torch.equal(dense(x3), joined(x3)) and torch.equal(dense(x1), linear(x1)) and "half" not in dense.kept
    switch.on = True
    assert torch.equal(dense(x1), half(x1)) and dense.kept["half"].dtype == torch.float16
    switch.on = False
    assert torch.equal(dense(x1), linear(x1)) and "half" in dense.kept  # kept for the next time it is on
    switch = weights_module.LazySwitch(on=True)
    late = [Dense(parts, plan, switch) for _ in range(3)]
    before = Dense([p.clone() for p in parts], ("linear",) * len(ROWS))
    parts[0].add_(1.0)  # an optimizer step before the copy was made
    with caplog.at_level("WARNING", logger="rlvr.rollout.weights"):
        ys = [d(x1) for d in late for _ in range(2)]
    assert caplog.text.count("changed after its copies were made") == 1
    assert all("half" not in d.kept for d in late) and all(torch.equal(y, before(x1)) for y in ys)


@torch.no_grad()
def test_a_decode_calls_numbers_do_not_depend_on_what_the_engine_decoded_before(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lazy float16 form takes over after a call's own `LAZY_AFTER` steps that have it (from the
    first, for a call that starts with one row and asks for that many tokens), never from a count
    kept across calls: the same call gives the same tokens and log-probs, bit for bit, on an
    engine that decoded something else first (and made the copy) and on a fresh one, as a resumed
    run needs. The call that starts with one row runs float16 products: its numbers differ from
    those of the plan's other form."""
    if why := forms_module.form_unavailable("half", torch.bfloat16):
        pytest.skip(why)
    monkeypatch.setattr(static_decode, "LAZY_AFTER", 4)
    plan = ("half",) + ("linear",) * (len(ROWS) - 1)
    monkeypatch.setattr(weights_module, "product_plans", lambda model: Plans(plan, plan))
    model = copy.deepcopy(tiny_model).bfloat16()
    prompt = [encode(tiny_tokenizer, PROMPTS[0])]

    def run(engine: EmbeddedEngine, tokens: int) -> list[Completion]:
        return engine.generate(prompt, SamplingParams(max_new_tokens=tokens, n=1), seeds=[[7]])[0]

    def fresh() -> EmbeddedEngine:
        return EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[], decoder="static")

    used = fresh()
    run(used, 6)  # one row, 6 ≥ 4 tokens: float16 from its first step, the copy made
    assert "half" in used._fused_weights().qkv[0].kept  # type: ignore[union-attr]
    short_after, short_alone = run(used, 3), run(fresh(), 3)  # 3 < 4 tokens: the other form throughout
    assert short_after == short_alone
    monkeypatch.setattr(static_decode, "LAZY_AFTER", 2)
    assert run(fresh(), 3) != short_alone  # the same call on float16 products: other numbers, which a leak would show


def test_choose_plan_takes_each_buckets_fastest_within_one_copy_of_the_weights() -> None:
    """Hand-made timings over the 7 buckets. Free forms ("linear", "left") always count; of the
    forms that copy the weight, one at most: "mkl" wins buckets 1-3 by a little and "onednn"
    buckets 4-7 by a lot, so "onednn" is the copy kept (mean slowdown against the fastest form at
    each bucket: with onednn 1.1 at buckets 1-3, else 1; with mkl 1 at 1-3 and 2 at 4-7)."""
    times = {"linear": [5, 5, 5, 5, 5, 5, 5], "left": [4, 1.1, 4, 8, 8, 8, 8],
             "mkl": [1, 1, 1, 4, 4, 4, 4], "onednn": [1.1, 1.2, 1.1, 2, 2, 2, 2]}
    assert choose_plan(times) == ("onednn", "left", "onednn", "onednn", "onednn", "onednn", "onednn")
    times["mkl"] = [1, 1, 1, 2.1, 2.1, 2.1, 2.1]  # now close everywhere and better at 1-3: mkl
    assert choose_plan(times) == ("mkl", "mkl", "mkl", "mkl", "mkl", "mkl", "mkl")
    assert choose_plan({"linear": [2] * 7, "left": [1] * 7}) == ("left",) * 7  # no copying form: none kept
    assert choose_plan({"linear": [2] * 7, "left": [1] * 7, "xw": [1.5] * 7}) == ("left",) * 7  # a copy only where it wins


def test_a_second_copy_is_kept_only_within_the_budget_and_where_it_saves_enough() -> None:
    """With a budget of two copies, "mkl" for buckets 1-3 and "onednn" for 4-7 (summed slowdown 7
    + 2 · COPY_WORTH, against 7.3 + COPY_WORTH for onednn alone); a second copy that saves less
    than `COPY_WORTH` (0.05 in all at bucket 1) is not kept."""
    times = {"linear": [5] * 7, "left": [4, 1.1, 4, 8, 8, 8, 8],
             "mkl": [1, 1, 1, 4, 4, 4, 4], "onednn": [1.1, 1.2, 1.1, 2, 2, 2, 2]}
    assert choose_plan(times, copies=2) == ("mkl", "mkl", "mkl", "onednn", "onednn", "onednn", "onednn")
    assert choose_plan(times, copies=1) == ("onednn", "left", "onednn", "onednn", "onednn", "onednn", "onednn")
    assert choose_plan({"left": [2] * 7, "onednn": [1.05] + [1] * 6, "half": [1, 9, 9, 9, 9, 9, 9]},
                       copies=2) == ("onednn",) * 7
    assert choose_plan({"left": [2] * 7, "onednn": [1.5] + [1] * 6, "half": [1, 9, 9, 9, 9, 9, 9]},
                       copies=2) == ("half",) + ("onednn",) * 6


def test_the_copy_budget_follows_the_machines_memory(tiny_model: LlamaForCausalLM, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    """Two copies where two take at most 1/16 of the memory, else one; one where memory is unknown.
    The memory is the machine's, or its container's limit where that is lower (cgroup v2 or v1;
    "max" is no limit)."""
    size = sum(p.numel() * p.element_size() for p in tiny_model.model.layers.parameters())
    size += tiny_model.lm_head.weight.numel() * tiny_model.lm_head.weight.element_size()
    for memory, budget in ((32 * size, 2), (32 * size - 1, 1), (None, 1)):
        monkeypatch.setattr(plans_module, "machine_memory", lambda memory=memory: memory)
        assert plans_module.copy_budget(tiny_model) == budget
    monkeypatch.undo()
    proc = tmp_path / "cgroup"
    monkeypatch.setattr(models, "PROC_CGROUP", proc)
    monkeypatch.setattr(models, "CGROUP_ROOT", tmp_path)
    monkeypatch.setattr(models.os, "sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1000)

    def memory() -> int | None:  # read afresh: a process reads it once
        models.machine_memory.cache_clear()
        return models.machine_memory()

    assert memory() == 4096 * 1000  # no cgroup list
    proc.write_text("4:memory:/job/step\n1:cpu:/\n0::/slice/unit\n2:memory:/../elsewhere\n")
    assert memory() == 4096 * 1000  # no limit files
    (tmp_path / "memory").mkdir()
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "memory.limit_in_bytes").write_text("1\n")  # outside the mount: never read
    assert memory() == 4096 * 1000
    for folder, name, value in (("slice/unit", "memory.max", "max"), ("slice", "memory.max", "3000000"),
                                ("memory/job/step", "memory.limit_in_bytes", "9223372036854771712"),
                                ("memory/job", "memory.limit_in_bytes", "2000000")):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        (tmp_path / folder / name).write_text(value + "\n")
    assert memory() == 2000000  # the lowest limit, of a cgroup above its own (v1)
    (tmp_path / "memory.max").write_text("1000000\n")  # v2's root
    assert memory() == 1000000

    def unknown(name: str) -> int:
        raise ValueError(name)

    monkeypatch.setattr(models.os, "sysconf", unknown)
    assert memory() is None
    models.machine_memory.cache_clear()  # the real machine's again for later tests


def test_plans_are_probed_once_a_machine_and_dtype_unless_fixed(tiny_model: LlamaForCausalLM, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp32 or bf16 model on a CPU gets plans measured on its own weights (`probe_plan`): once
    for its CPU, torch version, dtype and shapes, kept in $RLVR_CACHE/products.json, so another
    process (a resumed run, a worker) reads the same plans without measuring. RLVR_PRODUCTS=fixed
    gives `fixed_plan`; any other value is refused."""
    monkeypatch.setattr(plans_module, "_PROBED", {})
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.delenv("RLVR_PRODUCTS", raising=False)
    probed: list[list[tuple[int, ...]]] = []

    def probe(weights: list[torch.Tensor], reps: int = 2, copies: int = 1) -> tuple[str, ...]:
        probed.append([tuple(w.shape) for w in weights])
        return ("left",) * len(ROWS) if weights[0].dtype == torch.float32 else ("linear",) * len(ROWS)

    monkeypatch.setattr(plans_module, "probe_plan", probe)
    plans = product_plans(tiny_model)
    layer = tiny_model.model.layers[0]
    assert plans == Plans(("left",) * len(ROWS), ("left",) * len(ROWS))
    assert probed[0][:4] == [tuple(w.shape) for w in forms_module.fused(layer)]  # the layers' fused weights
    assert probed[1] == [tuple(tiny_model.lm_head.weight.shape)]  # the whole head: under PROBE_BYTES
    assert product_plans(copy.deepcopy(tiny_model)) == plans and len(probed) == 2  # the same shapes: not again
    monkeypatch.setattr(plans_module, "_PROBED", {})  # another process on this machine
    assert product_plans(tiny_model) == plans and len(probed) == 2
    assert (tmp_path / "products.json").exists()
    head = tiny_model.lm_head.weight
    monkeypatch.setenv("RLVR_PRODUCTS", "fixed")
    assert product_plans(tiny_model) == Plans(fixed_plan(head), fixed_plan(head, head=True))
    monkeypatch.setenv("RLVR_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="RLVR_PRODUCTS"):
        product_plans(tiny_model)
    monkeypatch.delenv("RLVR_PRODUCTS")
    bf16 = copy.deepcopy(tiny_model).bfloat16()
    assert product_plans(bf16) == Plans(("linear",) * len(ROWS), ("linear",) * len(ROWS))  # its own plans
    assert len(probed) == 4


def test_the_probe_leaves_the_global_random_state_alone(tiny_model: LlamaForCausalLM) -> None:
    """A run's random draws are its own: probing (the first fp32 engine of a process, or not, as the
    cache decides) must not move the global generator, or a resumed run would diverge."""
    state = torch.get_rng_state()
    plans_module.probe_plan(list(forms_module.fused(tiny_model.model.layers[0])), reps=1)
    assert torch.equal(torch.get_rng_state(), state)


def test_the_real_probe_times_every_available_form(tiny_model: LlamaForCausalLM,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`probe_plan` on the tiny model's weights: a plan of forms this PyTorch has, one per bucket,
    with at most one form that copies the weight; a form that gives a wrong product is never
    chosen, however fast."""
    plan = plans_module.probe_plan(list(forms_module.fused(tiny_model.model.layers[0])), reps=1)
    assert len(plan) == len(ROWS) and set(plan) <= set(available_forms(torch.float32))
    assert sum(FORMS[name].copies for name in set(plan)) <= 1
    wrong = FORMS["xw"]._replace(run=lambda w, x, b: torch.zeros(len(x), w.shape[1], dtype=x.dtype))
    monkeypatch.setitem(FORMS, "xw", wrong)
    assert "gives a wrong product" in (forms_module.form_unavailable("xw", torch.float32) or "")

    def float16_sum(h: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:  # "half" summing in float16
        terms = x.half()[:, None, :] * h[None]
        total = torch.zeros(len(x), len(h), dtype=torch.float16) if b is None else b.half().expand(len(x), -1).clone()
        for j in range(terms.shape[-1]):
            total += terms[..., j]
        return total.to(x.dtype)

    monkeypatch.setitem(FORMS, "narrow", FORMS["half"]._replace(run=float16_sum))
    assert "gives a wrong product" in (forms_module.form_unavailable("narrow", torch.bfloat16) or "")
    assert "xw" not in plans_module.probe_plan(list(forms_module.fused(tiny_model.model.layers[0])), reps=1)


@torch.no_grad()
def test_bf16_without_onednn_packing_runs_the_plain_product(monkeypatch: pytest.MonkeyPatch,
                                                            tiny_model: LlamaForCausalLM) -> None:
    """Where oneDNN cannot pack bf16 (no oneDNN; an AVX2-only CPU), the probe says why, and the
    fixed plan keeps the plain bf16 forms: an [in, out] copy per projection and the model's own
    output head (no extra copy of it); the measured plan has no oneDNN form."""
    bf16_packing_unavailable.cache_clear()
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    monkeypatch.setenv("RLVR_PRODUCTS", "fixed")
    try:
        assert bf16_packing_unavailable() == "this PyTorch has no oneDNN"
        model = copy.deepcopy(tiny_model).bfloat16()
        weights = FusedWeights(model)
        assert isinstance(weights.qkv[0], Dense) and weights.qkv[0].plan == ("xw",) * len(ROWS)
        assert isinstance(weights.head, Dense) and weights.head.plan == ("linear",) * len(ROWS)
        assert weights.head.kept["linear"].data_ptr() == model.lm_head.weight.data_ptr()
        assert "onednn" not in plans_module.probe_plan(list(forms_module.fused(model.model.layers[0])), reps=1)
    finally:
        bf16_packing_unavailable.cache_clear()


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
    bias = torch.randn(96, generator=gen).to(dtype)  # a bias is added to the product, on both paths
    for kernel_rows in (0, len(x)):  # x's 3 rows beyond the kernel's count, then through the kernel
        monkeypatch.setattr(Int8, "KERNEL_ROWS", kernel_rows)
        assert torch.equal(Int8(w_oi, bias)(x), int8(x) + bias)


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


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", list(FORMS))
def test_the_static_decoder_matches_a_full_forward_in_every_form(
    form: str, dtype: torch.dtype, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever plan the probe picks, the decoder's wiring holds: with every projection and the
    head in one form, each decode step's logits equal a full forward pass. fp32: to summation
    order (1e-4, as the float16 test on exact copies). bf16: to bf16 rounding. Both sides round
    every product and norm to 8 bits, in other places and orders: ~10 roundings in series (two
    layers of three products and two norms, the final norm, the head) of ≤ 2^-8 each, on each
    side, suggest a difference of up to ~20 · 2^-8 ≈ 8% of the logits' scale: a margin, not a
    bound (each rounding is relative to its own product's Σ|x·w|, not to the largest logit; seen
    3.5%). A projection fused or split in the wrong order, or a head left out, moves the logits
    by O(1): reversing the layers' q/k/v fails it."""
    if why := forms_module.form_unavailable(form, dtype):
        pytest.skip(why)
    plan = (form,) * len(ROWS)
    monkeypatch.setattr(weights_module, "product_plans", lambda model: Plans(plan, plan))
    model = tiny_model if dtype == torch.float32 else copy.deepcopy(tiny_model).bfloat16()
    weights = FusedWeights(model)
    assert isinstance(weights.head, Dense) and weights.head.plan == plan and weights.qkv[0].plan == plan
    assert weights.in_fp16 == (form == "half")
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    if dtype == torch.float32:
        steps_against_a_full_forward(engine, weights, prompts, lambda full: 1e-4)
    else:
        worst = steps_against_a_full_forward(engine, weights, prompts, lambda full: 0.08 * float(full.abs().max()))
        assert worst > 0  # bf16 rounding differs somewhere: the comparison is not of a tensor with itself


@torch.no_grad()
@pytest.mark.parametrize("fixed_shapes", [False, True])
@pytest.mark.parametrize("norm", ["input_layernorm", "post_attention_layernorm"])
def test_a_step_that_overflows_float16_runs_again_in_the_models_dtype(
    norm: str, fixed_shapes: bool, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast,
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A bf16 model whose q/k/v or MLP inputs exceed float16's range (a norm's weight in the first
    layer scaled by 2^17, which bf16 holds): on "half" products they are inf. The decoder sees it,
    warns, runs the step again on the model's own dtype's forms, and keeps to them for the rest
    of the call: every step's logits equal, bit for bit, those of a decoder built on those forms
    from the start (so the step run again wrote its keys and values where the first had, at the
    same positions), in plain and in fixed-shape steps."""
    if why := forms_module.form_unavailable("half", torch.bfloat16):
        pytest.skip(why)
    model = copy.deepcopy(tiny_model).bfloat16()
    getattr(model.model.layers[0], norm).weight.mul_(2**17)
    x = getattr(model.model.layers[0], norm)(torch.randn(1, 1, model.config.hidden_size).bfloat16())
    half = FORMS["half"]
    qkv, _, gate_up, _ = forms_module.fused(model.model.layers[0])
    weight = qkv if norm == "input_layernorm" else gate_up
    assert not torch.isfinite(half.run(half.prepare(weight), x[0], None)).all()  # what the check must catch
    plans = {"half": Plans(("half",) * len(ROWS), ("half",) * len(ROWS)),
             "linear": Plans(("linear",) * len(ROWS), ("linear",) * len(ROWS))}
    built = {}
    for name, plan in plans.items():
        monkeypatch.setattr(weights_module, "product_plans", lambda model, plan=plan: plan)
        built[name] = FusedWeights(model)
    assert built["half"].in_fp16 and not built["linear"].in_fp16
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    decoders = []
    for weights in built.values():
        cache, _, mask_PT, _ = engine._prefill(prompts)
        decoders.append(StaticDecoder(model, weights, cache, mask_PT, 2, fixed_shapes=fixed_shapes))
    gen = torch.Generator().manual_seed(0)
    with caplog.at_level("WARNING", logger="rlvr.rollout.static_decode"):
        for _ in range(6):
            tok = torch.randint(3, 259, (2 * len(prompts),), generator=gen)
            on_half, on_linear = decoders[0].step(tok), decoders[1].step(tok)
            assert torch.isfinite(on_half).all() and torch.equal(on_half, on_linear)
    assert caplog.text.count("gave values that are not finite") == 1
    assert not decoders[0].weights.in_fp16 and decoders[0].weights.qkv[0].plan == ("linear",) * len(ROWS)
    assert built["half"].in_fp16  # the call's own weights: the engine's are left as they were for the next call


@torch.no_grad()
def test_a_float16_step_is_run_again_for_a_projection_that_overflowed_unseen_in_the_logits(
    tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture
) -> None:
    """A key of -inf only scores -inf: the logits can stay finite while the cache holds it. So a
    float16 step also checks its q/k/v projections. Here a projection's output is made -inf after
    attention has read it (so the logits are those of finite numbers): that alone sends the step
    round again on the model's own dtype's forms. A step of a row count without float16
    products is not checked."""
    if why := forms_module.form_unavailable("half", torch.bfloat16):
        pytest.skip(why)
    model = copy.deepcopy(tiny_model).bfloat16()
    plan = ("half",) + ("linear",) * (len(ROWS) - 1)
    monkeypatch.setattr(weights_module, "product_plans", lambda model: Plans(plan, plan))
    weights = FusedWeights(model)
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    real, made = weights.qkv[0], []

    def recorded(x: torch.Tensor) -> torch.Tensor:
        made.append(real(x))
        return made[-1]

    def poisoned_logits(self: StaticDecoder, last: torch.Tensor, logits=StaticDecoder._logits) -> torch.Tensor:
        for y in made:
            y[:, -1] = float("-inf")
        made.clear()
        return logits(self, last)

    weights.qkv[0] = recorded  # type: ignore[assignment]
    monkeypatch.setattr(StaticDecoder, "_logits", poisoned_logits)
    cache, _, mask_PT, _ = engine._prefill([encode(tiny_tokenizer, PROMPTS[0])] * 2)
    with caplog.at_level("WARNING", logger="rlvr.rollout.static_decode"):
        assert torch.isfinite(StaticDecoder(model, weights, cache, mask_PT, 1).step(torch.tensor([5, 6]))).all()
        assert "not finite" not in caplog.text  # two rows: "linear", not checked
        cache, _, mask_PT, _ = engine._prefill([encode(tiny_tokenizer, PROMPTS[0])])
        one = StaticDecoder(model, weights, cache, mask_PT, 1, new_tokens=static_decode.LAZY_AFTER)  # float16 at once
        assert torch.isfinite(one.step(torch.tensor([5]))).all()
    assert "not finite" in caplog.text and one._overflowed  # one row: checked, and run again without float16
    assert not weights.switch.on and "half" in weights.qkv[1].kept  # float16 was on, and is off for this call


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
