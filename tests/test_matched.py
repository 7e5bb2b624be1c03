"""Matched numerics (rlvr.rollout.matched): in bf16 the embedded engine's log-probs are the learner's.

Tolerance: with matching, the engine's and the learner's logits are the same bf16 numbers, and
what is left is the last step, the sampler's float32 `log_softmax` against the learner's float32
`logsumexp`: a few float32 roundings of numbers of the logits' size (|z| < 30 here, 2^-24 of it
~2e-6 each), so 1e-5. The fast engine's bf16 drift on the same model is 1e-3 to 1e-2.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rlvr.attention import EXACT, exact_attention, exact_sdpa, is_sdpa
from rlvr.config import load_config
from rlvr.models import FEWEST_ROWS, product_width
from rlvr.rollout import matched
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.forms import FORMS
from rlvr.rollout.matched import matched_plans, unmatched_reason
from rlvr.train.loop import train
from rlvr.train.logprobs import shared_prompt_logprobs, token_logprobs
from rlvr.train.setup import _numerics
from rlvr.types import SamplingParams
from tests.test_train import overrides, read_metrics
from tests.tiny import EOS_ID, make_tiny_model, make_tiny_qwen2, make_tiny_tokenizer, saved_with_tokenizer

pytestmark = pytest.mark.dtype_independent  # every model here is pinned to bf16 (or fp32)


def _model() -> torch.nn.Module:
    """The tiny Llama, 128 wide (4 heads of 32, MLP 256) in bf16: oneDNN's products of its 32-wide
    rows sum 1-4 rows in another order than many on a Zen 5 EPYC, which matching refuses; at 128
    they do not."""
    return make_tiny_model(dtype=torch.bfloat16, head_dim=32, hidden_size=128, intermediate_size=256)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`_model` and the tiny tokenizer saved as a model folder, for `rlvr train`."""
    return saved_with_tokenizer(_model(), tmp_path_factory.mktemp("wide"))  # type: ignore[no-any-return]

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
    # by hand in float64: the grouped heads repeated, scores, the mask (causal where none), softmax
    keys, values = k.double().repeat_interleave(2, 1), v.double().repeat_interleave(2, 1)
    scores = q.double() @ keys.transpose(-1, -2) * 8**-0.5
    allowed = mask if mask is not None else torch.ones(6, 6, dtype=torch.bool).tril()
    want = (scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ values).transpose(1, 2)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want.to(torch.bfloat16))
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = torch.autograd.grad(out, (q, k, v), grad)
    leaves = [t.detach().float().requires_grad_() for t in (q, k, v)]
    out32, _ = sdpa_attention_forward(_Attention(), *leaves, mask, scaling=8**-0.5)
    for g, w in zip(got, torch.autograd.grad(out32, leaves, grad.float())):
        assert g.dtype == torch.bfloat16 and torch.equal(g, w.to(torch.bfloat16))
    # only the keys need a gradient (e.g. a frozen query path): the others get none
    q2, v2 = q.detach(), v.detach()
    out, _ = exact_sdpa(_Attention(), q2, k, v2, mask, scaling=8**-0.5)
    (only,) = torch.autograd.grad(out, (k,), grad)
    assert torch.equal(only, got[1])


STOPS = [EOS_ID, *range(100, 108)]
"""Stop tokens enough that most rows finish within 40 tokens, at different steps: the decoder
compacts its float64 buffers, and rows left alone run joined."""


def _qwen2() -> torch.nn.Module:
    """A tiny Qwen2 as wide as `_model`, in bf16, with q/k/v biases of the size of what they are
    added to."""
    return make_tiny_qwen2(hidden_size=128, intermediate_size=256, bias_std=2.0, dtype=torch.bfloat16)  # type: ignore[no-any-return]


def _mismatch(numerics: str, decoder: str, engine: EmbeddedEngine | None = None,
              make: Callable[[], torch.nn.Module] = _model) -> torch.Tensor:
    """|engine − learner| of every sampled token's log-prob: three prompts of other lengths, four
    samples each, rows finishing at different steps (`STOPS`)."""
    tokenizer, model = make_tiny_tokenizer(), make().eval()
    if engine is None:
        engine = EmbeddedEngine(model, tokenizer, eos_token_ids=STOPS, seed=0, decoder=decoder,  # type: ignore[arg-type]
                                numerics=numerics)  # type: ignore[arg-type]
    model = engine.model
    prompts = [tokenizer.encode("hello there, how are you " * k) for k in (1, 3, 5)]
    groups = engine.generate(prompts, SamplingParams(max_new_tokens=40, n=4))
    completions = [list(c.token_ids) for group in groups for c in group]
    sampled = torch.tensor([lp for group in groups for c in group for lp in c.logprobs], dtype=torch.float64)
    with torch.no_grad():
        learner, _ = shared_prompt_logprobs(model, prompts, completions, [i for i in range(3) for _ in range(4)], 0)
    lengths = sorted(len(c) for c in completions)
    assert len(sampled) > 100 and lengths[2] < lengths[-3], lengths  # rows finished at different steps
    return (learner.double() - sampled).abs()


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_matched_engine_samples_with_the_learners_logprobs(decoder: str) -> None:
    model = _model()
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    exact, fast = _mismatch("matched", decoder), _mismatch("fast", decoder)
    assert float(exact.max()) < AFTER_ROUNDING
    assert float(fast.mean()) > 10 * AFTER_ROUNDING  # what matching removes: bf16's drift (measured 3e-3-1e-2)


def test_matched_sets_the_models_attention_and_its_plans_have_no_float16_form() -> None:
    model = _model()
    plans = matched_plans(model)
    if isinstance(plans, str):
        pytest.skip(f"matching is not available on this CPU: {plans}")
    assert not any(FORMS[name].in_fp16 for name in (*plans.layers, *plans.head))
    EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    assert model.config._attn_implementation == EXACT and is_sdpa(model)


def test_where_no_form_gives_the_learners_bits_matching_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(matched, "_CHOSEN", {})
    off = {name: form._replace(run=lambda kept, x, b, run=form.run: run(kept, x, b) * (1 + 2**-6))
           for name, form in FORMS.items()}  # every form a bf16 step away from the learner's product
    monkeypatch.setattr(matched, "FORMS", off)
    model = _model()
    why = matched_plans(model)
    assert isinstance(why, str) and "no product form gives the learner's bits at 1 rows" in why
    with pytest.raises(ValueError, match="matched numerics cannot run here: no product form"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    assert model.config._attn_implementation != EXACT  # nothing changed on the way to the error


def test_where_only_one_row_rounds_otherwise_a_row_runs_as_two(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU whose one-row kernel rounds differently (oneDNN's bf16 1536→576 product on a Zen 5:
    13% of single rows): the probe must notice it on some row, and run one row as two there."""
    if isinstance(why := matched_plans(_model()), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    monkeypatch.setattr(matched, "_CHOSEN", {})
    off = {name: form if form.paired else
           form._replace(run=lambda kept, x, b, run=form.run: run(kept, x, b) * (1 + 2**-6) if len(x) == 1 else run(kept, x, b))
           for name, form in FORMS.items()}  # the paired forms keep the true kernels: they never run one row
    monkeypatch.setattr(matched, "FORMS", off)
    model = _model()
    plans = matched_plans(model)
    assert not isinstance(plans, str), plans
    assert off[plans.layers[0]].paired and off[plans.head[0]].paired
    assert not any(off[name].paired for name in (*plans.layers[1:], *plans.head[1:]))


def test_the_hf_decoder_matches_only_where_the_models_own_products_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Hugging Face decoder's steps run the model's own `F.linear` at every count of running
    rows: where one count rounds otherwise (here: a layer's single row), it cannot match, and the
    static decoder (its products in checked forms) still can."""
    model = _model()
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    monkeypatch.setattr(matched, "_CHOSEN", {})
    monkeypatch.setattr(matched, "_OWN", {})
    vocab = model.config.vocab_size

    class OffAtOneRow:  # torch.nn.functional, its linear a bf16 step off for one row of a layer's product
        def __getattr__(self, name: str) -> object:
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            y = torch.nn.functional.linear(x, w, b)
            return y * (1 + 2**-6) if len(x) == 1 and w.shape[0] != vocab else y

    monkeypatch.setattr(matched, "F", OffAtOneRow())
    with pytest.raises(ValueError, match="rounds 1 rows otherwise than the learner's, and the Hugging Face decoder"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], decoder="hf", numerics="matched")
    EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], decoder="static", numerics="matched")


def test_after_the_thread_count_changes_the_forms_are_probed_again() -> None:
    """rlvr.cores fits torch's threads to the free cores between steps, and oneDNN may split a
    product otherwise at another count: a matched engine probes its forms again, and stays matched."""
    model = _model()
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    engine = EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=STOPS, seed=0, numerics="matched")
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    torch.set_num_threads(other)
    try:
        assert float(_mismatch("matched", "static", engine).max()) < AFTER_ROUNDING
        assert engine._plans_threads == other
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_projections_with_biases_match_with_the_bias_inside_the_product(decoder: str) -> None:
    # Qwen2's q/k/v biases: the decoder adds them inside its fused product, as nn.Linear does
    if isinstance(why := matched_plans(_qwen2()), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    exact, fast = _mismatch("matched", decoder, make=_qwen2), _mismatch("fast", decoder, make=_qwen2)
    assert float(exact.max()) < AFTER_ROUNDING
    assert float(fast.mean()) > 10 * AFTER_ROUNDING


def test_a_bias_on_only_some_of_q_k_v_is_not_matched_and_auto_falls_back() -> None:
    model = _qwen2()
    model.model.layers[-1].self_attn.v_proj.bias = None
    assert "only some of the query/key/value projections have a bias" in (unmatched_reason(model) or "")
    assert isinstance(matched_plans(model), str)  # a reason, not an error: "auto" then runs fast


def test_a_bias_added_to_the_rounded_product_is_not_matched(monkeypatch: pytest.MonkeyPatch) -> None:
    # the probe's normal inputs show where a bias is added: with every form adding it after rounding
    # (as "left" does), no form gives nn.Linear's bits
    if isinstance(why := matched_plans(_qwen2()), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    monkeypatch.setattr(matched, "_CHOSEN", {})
    for name in ("linear", "onednn", "xw", "mkl", "onednn_paired", "linear_paired"):
        form = FORMS[name]
        monkeypatch.setitem(FORMS, name, form._replace(run=lambda k, x, b, run=form.run: run(k, x, None) + b
                                                       if b is not None else run(k, x, None)))
    assert "no product form gives the learner's bits" in str(matched_plans(_qwen2()))


def test_the_kl_reference_computes_as_the_matched_policy_does(wide_dir: Path, tmp_path: Path) -> None:
    from rlvr.train.methods.kl import on_rank

    policy = _model()
    exact_attention(policy)
    cfg = load_config(None, [*overrides(wide_dir, tmp_path, "kl"), "algo.kl_coef=0.1"])
    extras = on_rank(cfg, policy, None)  # type: ignore[arg-type]
    assert extras is not None and extras.ref_model is not None
    assert extras.ref_model.config._attn_implementation == EXACT


def test_matching_is_for_16_bit_models_on_a_cpu() -> None:
    model = make_tiny_model()  # fp32
    assert "matching is for bfloat16 models" in (unmatched_reason(model) or "")
    with pytest.raises(ValueError, match="matched numerics cannot run here: the model is float32"):
        EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[EOS_ID], numerics="matched")
    eager = _model()
    eager.set_attn_implementation("eager")
    assert "attention is 'eager'" in (unmatched_reason(eager) or "") and not exact_attention(eager)


def test_auto_numerics_match_where_the_engine_shares_the_learners_model(tiny_dir: Path, tmp_path: Path) -> None:
    model = _model()
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


def test_a_bf16_run_logs_no_mismatch_with_matched_numerics(wide_dir: Path, tmp_path: Path) -> None:
    """Two GRPO steps in bf16 (the engine on the learner's weights), "auto" numerics and "fast": the
    logged sampler/learner log-ratio is rounding with matching, at step 2 too (after an update),
    and bf16's drift without."""
    if isinstance(why := matched_plans(_model()), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    logged = {}
    for numerics in ("auto", "fast"):
        train(load_config(None, [*overrides(wide_dir, tmp_path, numerics, sampling__max_new_tokens=24),
                                 'train.precision="bf16"', 'engine.dtype="bfloat16"',
                                 f'engine.numerics="{numerics}"']), quiet=True)
        logged[numerics] = read_metrics(tmp_path / numerics)
    for row in logged["auto"]:
        assert row["mismatch_logratio_abs"] < AFTER_ROUNDING and row["mismatch_outside_band"] == 0, row
    assert min(row["mismatch_logratio_abs"] for row in logged["fast"]) > 10 * AFTER_ROUNDING, logged["fast"]


def _token_rows(model: torch.nn.Module, run: Callable[[], object]) -> list[int]:
    """The token rows each of `model`'s layer projections (every `nn.Linear` but the output head)
    runs in `run`."""
    rows: list[int] = []
    hooks = [module.register_forward_pre_hook(lambda _, args: rows.append(args[0].numel() // args[0].shape[-1]))
             for module in model.modules() if isinstance(module, torch.nn.Linear) and module is not model.lm_head]
    try:
        run()
    finally:
        for hook in hooks:
            hook.remove()
    assert rows, "no projection ran"
    return rows


def test_tiny_forwards_run_their_products_on_at_least_four_tokens() -> None:
    """A product of 1-3 rows may sum in another order than one of many (oneDNN's 1536→576 bf16
    product on a Zen 5 EPYC): the bundled model's log-probs of a 2-token completion alone in its
    forward differed from the engine's by up to 0.18 nats, 23 of 160 log-probs beyond 1e-4 (docs/LOG.md,
    session 40). So the learner's forwards and the engine's prefills run at least `FEWEST_ROWS`
    tokens, padded where fewer."""
    model = _model()
    engine = EmbeddedEngine(model, make_tiny_tokenizer(), eos_token_ids=[], seed=0)
    row = torch.tensor([[5, 6, 7]])
    runs = {
        "shared-prompt learner": lambda: shared_prompt_logprobs(model, [[5]], [[6, 7]], [0], 0),
        "whole-row learner": lambda: token_logprobs(model, row, torch.ones_like(row), torch.tensor([[0, 1, 1]])),
        "prefill of a one-token prompt": lambda: engine.generate([[5]], SamplingParams(max_new_tokens=2)),
    }
    with engine.reusing_prefixes():
        stored = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_new_tokens=1))[0][0].token_ids
        runs["prefill of a short suffix"] = lambda: engine.generate([[5, 6, 7, 8, 9, *stored, 10]],
                                                                        SamplingParams(max_new_tokens=1))
        fewer = {name: min(_token_rows(model, run)) for name, run in runs.items()}
    assert all(rows >= FEWEST_ROWS for rows in fewer.values()), fewer


def test_padding_a_tiny_forward_changes_no_log_prob() -> None:
    """The pad columns that widen a tiny forward are masked and come after the real tokens: in
    float64 the log-probs equal those of the model's own forward on the tokens alone (up to a
    float64 sum's order)."""
    model = make_tiny_model(dtype=torch.float64)
    tokens = [5, 6, 7]
    with torch.no_grad():
        own = model(torch.tensor([tokens])).logits[0].log_softmax(-1)
        own_N = own[[0, 1], [6, 7]]
        row = torch.tensor([tokens])
        whole_BT, _ = token_logprobs(model, row, torch.ones_like(row), torch.tensor([[0, 1, 1]]))
        shared_N, _ = shared_prompt_logprobs(model, [[5]], [[6, 7]], [0], 0)
    assert whole_BT.shape == (1, 3)
    torch.testing.assert_close(whole_BT[0, 1:], own_N, atol=1e-12, rtol=0)
    torch.testing.assert_close(shared_N, own_N, atol=1e-12, rtol=0)


def test_product_width() -> None:
    assert [product_width(rows, 1) for rows in (1, 2, 3, 4, 9)] == [4, 2, 2, 1, 1]
    assert product_width(1, 7) == 7 and product_width(2, 0) == 2


def test_the_head_is_checked_at_every_count_it_runs_unpadded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The output head runs 1-3 rows where nothing pads it (a prefill's last token, a learner chunk's
    last scored tokens): a head off at 2 rows alone must stop matching."""
    model = _model()
    if isinstance(why := matched_plans(model), str):
        pytest.skip(f"matching is not available on this CPU: {why}")
    monkeypatch.setattr(matched, "_CHOSEN", {})
    vocab = model.config.vocab_size

    class OffAtTwoRows:  # torch.nn.functional, its head product a bf16 step off for two rows
        def __getattr__(self, name: str) -> object:
            return getattr(torch.nn.functional, name)

        @staticmethod
        def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
            y = torch.nn.functional.linear(x, w, b)
            return y * (1 + 2**-6) if len(x) == 2 and w.shape[0] == vocab else y

    monkeypatch.setattr(matched, "F", OffAtTwoRows())
    why = matched_plans(model)
    assert isinstance(why, str) and "at 2 rows" in why, why
