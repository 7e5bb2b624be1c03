"""rlvr.rollout.engine.EmbeddedEngine on a tiny fp32 Llama: shapes, logprobs, finish reasons, determinism.

The central check recomputes every sampled token's log-probability from one full-sequence
forward pass without cache or padding; it fails if left padding, positions, the KV-cache repeat
for the n samples, or the removal of finished rows were wrong. `steer` fakes a model that
prefers chosen continuations, to make EOS and stop strings happen on cue.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerFast

from rlvr.rollout import static_decode
from rlvr.rollout.engine import EmbeddedEngine, without_cudnn_attention
from rlvr.types import SamplingParams
from tests.test_engine_contract import PROMPTS, encode, recompute_logprobs, reference_greedy
from tests.tiny import EOS_ID, make_tiny_model, make_tiny_qwen2

Model = LlamaForCausalLM
Tokenizer = PreTrainedTokenizerFast


@contextmanager
def steer(model: PreTrainedModel, follow: dict[int, int], bonus: float = 100.0) -> Iterator[None]:
    """Add `bonus` to the logit of token follow[t] at every position whose input token is t.

    The change depends only on the current input token, so cached decoding and a full forward
    pass see the same model. It hooks the embedding (to see the input ids) and the LM head (to
    change the logits), which both decoders call, so it steers either.
    """
    table_V = torch.full((model.config.vocab_size,), -1, dtype=torch.long)
    for current, nxt in follow.items():
        table_V[current] = nxt
    seen: list[torch.Tensor] = []

    def remember_ids(module: torch.nn.Module, args: tuple, output: Any) -> None:
        seen[:] = [args[0]]

    def add_bonus(module: torch.nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        ids_BT = seen[0]
        nxt_BT = table_V[ids_BT[:, ids_BT.shape[1] - logits.shape[1] :]]  # logits_to_keep may cut T
        b, t = (nxt_BT >= 0).nonzero(as_tuple=True)
        bias = torch.zeros_like(logits)
        bias[b, t, nxt_BT[b, t]] = bonus
        return logits + bias

    handles = [
        model.get_input_embeddings().register_forward_hook(remember_ids),
        model.lm_head.register_forward_hook(add_bonus),
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@pytest.fixture(params=["static", "static-shared", "hf"])
def decoder(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every engine test runs with both decoders, the static one also with its prompts' keys and
    values shared among the samples whatever the prompts' size (the tests' prompts are too short
    for it to share them by default)."""
    if request.param == "static-shared":
        monkeypatch.setattr(static_decode, "SHARE_FROM", 0)
        return "static"
    return str(request.param)


def everything_to(token: int, vocab_size: int = 259) -> dict[int, int]:
    return {t: token for t in range(vocab_size)}


def test_generate_restores_the_model_mode(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    """Shape, order, text and seeds are in the engine contract (tests/test_engine_contract.py)."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], max_batch_size=4, decoder=decoder)
    tiny_model.train()
    engine.generate([encode(tiny_tokenizer, p) for p in PROMPTS], SamplingParams(temperature=1.0, max_new_tokens=4, n=3))
    assert tiny_model.training


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, max_new_tokens=6, n=3),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=6, n=3),
    ],
    ids=["plain", "T0.7-topk-topp"],
)
@pytest.mark.parametrize("early_eos", [False, True], ids=["full-length", "early-eos"])
def test_logprobs_equal_full_sequence_recompute(
    tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str, params: SamplingParams, early_eos: bool
) -> None:
    # max_batch_size 6 with n = 3 puts two prompts in a chunk, so chunking is exercised too.
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], max_batch_size=6, seed=3, decoder=decoder)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    # early_eos: +4 on EOS everywhere makes p(EOS) ~ 0.2 per step, so rows leave the batch at different steps
    with steer(tiny_model, everything_to(EOS_ID), bonus=4.0 if early_eos else 0.0):
        out = engine.generate(prompts, params)
        for prompt, group in zip(prompts, out):
            for c in group:
                expected = recompute_logprobs(tiny_model, prompt, c, params)
                torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)
    lengths = [len(c.token_ids) for g in out for c in g]
    if early_eos:  # the case is only meaningful if some rows stopped while others ran on
        assert min(lengths) < params.max_new_tokens and max(lengths) == params.max_new_tokens
        for c in (c for g in out for c in g):
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == EOS_ID)
    else:
        assert lengths == [params.max_new_tokens] * 9


def test_length_finish_when_eos_never_comes(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    with steer(tiny_model, everything_to(EOS_ID), bonus=-1e4):
        out = engine.generate([encode(tiny_tokenizer, p) for p in PROMPTS], SamplingParams(max_new_tokens=5, n=2))
    for c in (c for g in out for c in g):
        assert c.finish_reason == "length" and len(c.token_ids) == 5 and EOS_ID not in c.token_ids


def test_eos_stops_and_is_kept_as_last_token(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    x, a = encode(tiny_tokenizer, "xa")
    # prompt "...x" → "a" → EOS
    with steer(tiny_model, {x: a, a: EOS_ID}):
        out = engine.generate([encode(tiny_tokenizer, "say x")], SamplingParams(max_new_tokens=10, n=3))
    for c in out[0]:
        assert c.token_ids == (a, EOS_ID) and c.finish_reason == "stop"
        assert c.text == "a"  # special tokens are left out of the text
        assert c.logprobs == pytest.approx([0.0, 0.0], abs=1e-6)  # a +100 bonus makes both certain


def test_any_of_several_eos_ids_stops(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID, 1], decoder=decoder)
    with steer(tiny_model, everything_to(1)):
        out = engine.generate([encode(tiny_tokenizer, "hi")], SamplingParams(max_new_tokens=10))
    assert out[0][0].token_ids == (1,) and out[0][0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("stop", "text"),
    [
        (("zz",), "aézz"),  # ASCII, two tokens
        (("é",), "aé"),  # one character, two byte tokens
        (("éz",), "aéz"),  # a stop string whose first character spans two tokens
        (("q", "é"), "aé"),  # the first stop string to appear wins
        (("q",), "aézzz"),  # never appears: max_new_tokens ends it
    ],
)
def test_stop_strings(
    tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str, stop: tuple[str, ...], text: str
) -> None:
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    x, a, z = encode(tiny_tokenizer, "xaz")
    e1, e2 = encode(tiny_tokenizer, "é")
    # prompt "...x" → a, é (two byte tokens), z, z, z, ...; the prompt itself contains "é zz"
    follow = {x: a, a: e1, e1: e2, e2: z, z: z}
    with steer(tiny_model, follow):
        out = engine.generate([encode(tiny_tokenizer, "é zz x")], SamplingParams(max_new_tokens=6, stop=stop, n=2))
    for c in out[0]:
        assert c.text == text
        assert c.finish_reason == ("length" if stop == ("q",) else "stop")
        assert len(c.token_ids) == len(text.encode())


def test_finished_rows_do_not_change_the_others(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    """Greedy: a batch where the middle row stops early gives each row what it gives alone."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    prompts = [encode(tiny_tokenizer, p) for p in ["The quick brown fox", "hi", "a, b"]]
    free = [engine.generate([p], params)[0][0].token_ids for p in prompts]
    # Make EOS follow the 2nd token of row 1's greedy continuation, a token the other rows never feed.
    others = {t for i in (0, 2) for t in (*free[i], prompts[i][-1])}
    trigger = free[1][1]
    assert trigger not in others and trigger not in free[1][:1]
    with steer(tiny_model, {trigger: EOS_ID}):
        batch = engine.generate(prompts, params)
        alone = [engine.generate([p], params)[0][0] for p in prompts]
    rows = [g[0] for g in batch]
    assert rows[1].token_ids == (*free[1][:2], EOS_ID) and rows[1].finish_reason == "stop"
    assert [r.finish_reason for r in rows] == ["length", "stop", "length"]
    for r, single in zip(rows, alone):
        assert r.token_ids == single.token_ids
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(single.logprobs), atol=1e-5, rtol=0)
    assert rows[0].token_ids == free[0] and rows[2].token_ids == free[2]


@pytest.mark.parametrize("share_from", [0, static_decode.SHARE_FROM])
@torch.no_grad()
def test_static_decoder_matches_hf_past_buffer_growth_and_compaction(
    tiny_model: Model, tiny_tokenizer: Tokenizer, share_from: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """70 new tokens outgrow the first key/value block (64 columns); EOS steered in at different
    steps makes the static decoder compact its buffers. Both decoders must agree token for token,
    the static one sharing its prompts' keys and values (0) or copying them to every sample, and
    also in the fixed shapes of its CUDA-graph steps (run here without capture)."""
    monkeypatch.setattr(static_decode, "SHARE_FROM", share_from)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=70, n=4)
    outs = {}
    with steer(tiny_model, everything_to(EOS_ID), bonus=2.5):  # p(EOS) ~ 0.05 per step
        for name in ("static", "fixed", "hf"):
            engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], seed=5,
                                    decoder="hf" if name == "hf" else "static")
            engine.cuda_graphs = name == "fixed"  # a CUDA device's steps, on the CPU
            outs[name] = engine.generate(prompts, params)
    static, fixed, hf = ([c for g in outs[d] for c in g] for d in ("static", "fixed", "hf"))
    lengths = sorted(len(c.token_ids) for c in static)
    # a quarter of the 12 rows stopped early (so the buffers were compacted), and some ran on
    assert lengths[3] < 70 and lengths[-1] == 70, lengths
    assert [c.token_ids for c in static] == [c.token_ids for c in hf] == [c.token_ids for c in fixed]
    for s, f, h in zip(static, fixed, hf):
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(h.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(h.logprobs), atol=1e-4, rtol=0)


@torch.no_grad()
def test_static_decoder_with_512_or_more_pad_columns(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """A short prompt batched with one 600 tokens longer has 600 left-pad columns: a whole block of
    a blocked CPU attention kernel masked out, which gave NaN with an all -inf mask on some torch
    versions (pytorch/pytorch#127055). The static decoder (its attention one SDPA call) must agree
    with the HF decoder token for token, log-probs finite and within 1e-4, in its plain steps and
    its fixed-shape (CUDA-graph) ones."""
    long = [3 + i % 250 for i in range(600)]
    prompts = [long, encode(tiny_tokenizer, PROMPTS[0])]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    outs = {}
    for name in ("static", "fixed", "hf"):
        engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[], seed=3,
                                decoder="hf" if name == "hf" else "static")
        engine.cuda_graphs = name == "fixed"
        outs[name] = [c for g in engine.generate(prompts, params) for c in g]
    for s, f, h in zip(outs["static"], outs["fixed"], outs["hf"]):
        assert s.token_ids == f.token_ids == h.token_ids
        assert all(math.isfinite(x) for x in s.logprobs + f.logprobs)
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(h.logprobs), atol=1e-4, rtol=0)
        torch.testing.assert_close(torch.tensor(f.logprobs), torch.tensor(h.logprobs), atol=1e-4, rtol=0)


def test_cuda_graphs_only_on_a_cuda_device(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """`cuda_graphs` (on by default) applies where the model is on a CUDA device; on the CPU the
    static decoder steps as before."""
    assert not EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID]).cuda_graphs


def test_generating_on_cuda_turns_cudnn_attention_off_and_back() -> None:
    """cuDNN's attention builds a plan for every new key length (`without_cudnn_attention`): off
    while any engine on a CUDA device generates, nested or from two threads at once, and put back
    as it was (on, or off where the user had turned it off) when the last is done; a CPU engine
    leaves it alone. The flag is PyTorch's, so this runs on a CPU build too."""
    import threading

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        for user_choice in (True, False):
            torch.backends.cuda.enable_cudnn_sdp(user_choice)
            with without_cudnn_attention(cpu):
                assert torch.backends.cuda.cudnn_sdp_enabled() == user_choice
            with without_cudnn_attention(cuda):
                assert not torch.backends.cuda.cudnn_sdp_enabled()
                with without_cudnn_attention(cuda):
                    assert not torch.backends.cuda.cudnn_sdp_enabled()
                assert not torch.backends.cuda.cudnn_sdp_enabled()  # the outer call still runs
            assert torch.backends.cuda.cudnn_sdp_enabled() == user_choice
            # two engines in threads, the first to start finishing first
            first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
            seen: list[bool] = []

            def first() -> None:
                with without_cudnn_attention(cuda):
                    first_in.set()
                    second_in.wait(5)
                first_out.set()

            def second() -> None:
                first_in.wait(5)
                with without_cudnn_attention(cuda):
                    second_in.set()
                    first_out.wait(5)
                    seen.append(torch.backends.cuda.cudnn_sdp_enabled())

            threads = [threading.Thread(target=first), threading.Thread(target=second)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            assert seen == [False]  # still off for the engine still running
            assert torch.backends.cuda.cudnn_sdp_enabled() == user_choice
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_static_decoder_handles_qkv_bias(tiny_tokenizer: Tokenizer) -> None:
    """Qwen2 has biases on the query/key/value projections; the fused projection must add them."""
    model = make_tiny_qwen2()
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=8)
    static = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static").generate(prompts, params)
    for prompt, group in zip(prompts, static):
        assert list(group[0].token_ids) == reference_greedy(model, prompt, 8)
    # a bias on some of q/k/v only (the decoder fuses the three): "auto" decodes through the model's own forward
    model.model.layers[-1].self_attn.k_proj.bias = None  # in a later layer than the first
    assert "some of the query, key and value projections" in (static_decode.unsupported_reason(model) or "")
    assert EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID]).decoder == "hf"


def test_unsupported_architecture_falls_back_to_hf(tiny_tokenizer: Tokenizer) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=259, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID])
    assert engine.decoder == "hf"
    out = engine.generate([encode(tiny_tokenizer, "hi")], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert list(out[0][0].token_ids) == reference_greedy(model, encode(tiny_tokenizer, "hi"), 3)
    with pytest.raises(ValueError, match="'gpt2' is not one of"):
        EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")


def test_static_decoder_sees_in_place_parameter_changes(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """The fused weight copies are cached between calls; an optimizer-style in-place update to a
    parameter, or new storage given to one (`p.data = ...`, which keeps its version counter),
    must invalidate them. The changed weights are fused ones (q/k/v, gate/up): copies, not the
    model's own tensors."""
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    before = engine.generate(prompts, params)
    assert engine.generate(prompts, params) == before  # cached copies, same weights
    mlp = tiny_model.model.layers[1].mlp
    in_place = lambda: mlp.up_proj.weight.mul_(-3.0)  # noqa: E731
    new_storage = lambda: setattr(mlp.gate_proj.weight, "data", mlp.gate_proj.weight * -3.0)  # noqa: E731
    for change in (in_place, new_storage):
        with torch.no_grad():
            change()
        after = engine.generate(prompts, params)
        assert after != before
        for prompt, group in zip(prompts, after):
            assert list(group[0].token_ids) == reference_greedy(tiny_model, prompt, 6)
        before = after


def test_a_sample_does_not_depend_on_its_batch(tiny_model: Model, tiny_tokenizer: Tokenizer, decoder: str) -> None:
    """Every sample has a random stream of its own: given the same seeds, a prompt gets the same
    samples alone, in a batch, or cut into chunks (what lets rollout workers share a call)."""
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], seed=4, decoder=decoder)
    seeds = engine.draw_seeds(3, params)
    together = engine.generate(prompts, params, seeds=seeds)
    assert together[0][0].token_ids != together[0][1].token_ids  # the n samples of a prompt differ
    chunked = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], max_batch_size=2, decoder=decoder)
    for i, p in enumerate(prompts):
        alone = chunked.generate([p], params, seeds=[seeds[i]])[0]
        assert [c.token_ids for c in alone] == [c.token_ids for c in together[i]]
        torch.testing.assert_close(torch.tensor([c.logprobs for c in alone]),
                                   torch.tensor([c.logprobs for c in together[i]]), atol=1e-5, rtol=0)
    tokens = lambda out: [[c.token_ids for c in g] for g in out]  # noqa: E731
    assert tokens(chunked.generate(prompts, params, seeds=seeds)) == tokens(together)
    with pytest.raises(ValueError, match="seeds"):
        engine.generate(prompts, params, seeds=seeds[:2])


def test_greedy_decoding_leaves_the_random_stream_alone(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """Evaluations decode greedily between training steps: they must not move the training stream."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], seed=2)
    state = engine.generator.get_state()
    engine.generate([encode(tiny_tokenizer, "hi")], SamplingParams(temperature=0.0, max_new_tokens=4, n=2))
    assert torch.equal(engine.generator.get_state(), state)
    engine.generate([encode(tiny_tokenizer, "hi")], SamplingParams(temperature=1.0, max_new_tokens=4))
    assert not torch.equal(engine.generator.get_state(), state)


def test_partial_rollouts_switch_weights_mid_sample(tiny_tokenizer: Tokenizer, decoder: str) -> None:
    """Weights offered while a call samples take over at the next token: the tokens before the
    switch are those the old weights sample, every log-prob is the one of the weights that
    sampled its token, and each completion says where the switch was."""
    old, new = make_tiny_model(seed=0), make_tiny_model(seed=1)
    params = SamplingParams(temperature=1.0, max_new_tokens=8, n=2)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    baseline = EmbeddedEngine(make_tiny_model(seed=0), tiny_tokenizer, eos_token_ids=[EOS_ID], max_batch_size=6,
                              seed=5, decoder=decoder).generate(prompts, params)
    engine = EmbeddedEngine(make_tiny_model(seed=0), tiny_tokenizer, eos_token_ids=[EOS_ID], max_batch_size=6,
                            seed=5, decoder=decoder)
    engine.version = 0
    calls = []

    def offer_on_fourth_call(*_: Any) -> None:  # runs inside generate: the call is busy, so it must wait
        calls.append(1)
        if len(calls) == 4:
            engine.offer_weights(new.state_dict(), 1)

    hook = engine.model.model.embed_tokens.register_forward_hook(offer_on_fourth_call)
    try:
        out = engine.generate(prompts, params)
    finally:
        hook.remove()
    assert engine.version == 1
    switches = {c.swapped_at for g in out for c in g}
    assert len(switches) == 1 and len(next(iter(switches))) == 1  # one switch, at the same token for every sample
    at = next(iter(switches))[0]
    assert 0 < at < params.max_new_tokens
    for prompt, group, base in zip(prompts, out, baseline):
        for c, b in zip(group, base):
            assert c.policy_version == 0
            assert c.token_ids[:at] == b.token_ids[:at]  # same seeds, same weights before the switch
            before = recompute_logprobs(old, prompt, c, params)[:at]
            after = recompute_logprobs(new, prompt, c, params)[at:]
            torch.testing.assert_close(torch.tensor(c.logprobs), torch.cat([before, after]), atol=1e-4, rtol=0)
    # offered while idle, the weights load at once, and the next call is wholly on them
    engine.offer_weights(old.state_dict(), 2)
    assert engine.version == 2
    again = engine.generate(prompts, params)
    assert all(c.swapped_at == () and c.policy_version == 2 for g in again for c in g)


class FakeGraphs:
    """A CPU stand-in for `StepGraphs`: a "capture" records the step without running it, and a
    replay runs it, writing into the tensor the capture returned, as a CUDA graph writes to its
    captured output. Each replay first checks what a real graph relies on: every tensor the step
    reads or writes by address is still the one captured (a layout change that forgot to count
    itself would fail here), and the column tensor holds the decoder's column."""

    def __init__(self) -> None:
        self.captures = self.replays = 0

    def run_and_capture(self, step: Any) -> tuple[torch.Tensor, tuple[Any, torch.Tensor]]:
        decoder = step.__self__
        out = step()
        captured = torch.empty_like(out)
        addresses = self.addresses(decoder)
        fakes = self

        class Replay:
            def replay(self) -> None:
                assert fakes.addresses(decoder) == addresses, "a tensor the graph reads moved without a new layout"
                assert int(decoder._col_t) == decoder.col
                captured.copy_(step())
                fakes.replays += 1

        self.captures += 1
        return out, (Replay(), captured)

    @staticmethod
    def addresses(decoder: Any) -> list[int]:
        tensors = [*decoder.keys, *decoder.values, *decoder.prompt_keys, *decoder.prompt_values,
                   decoder.neg_PW, decoder.pos_B, decoder._tok_B, decoder._col_t]
        return [t.data_ptr() for t in tensors]


@torch.no_grad()
@pytest.mark.parametrize("graphs", ["plain", "fixed-shapes", "replayed"])
def test_static_decoder_shares_prompt_keys_through_every_layout(
    tiny_model: Model, tiny_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch, graphs: str
) -> None:
    """The static decoder keeps one copy of each prompt's keys and values for its n samples. Rows
    leave in a pattern that makes it first re-lay the shared buffers (every prompt keeps a slot
    per running sample of its busiest prompt), then give up sharing (each running row its own
    prompt row, the prompt's columns joined to its buffers), then grow the buffers. At every
    step each running row's logits must equal a full forward pass over its own prompt + tokens
    (no cache, no padding); fp32 on 2 layers, where the two only differ in summation order
    (~1e-6), so 1e-4 catches a wrong column or row.

    ``graphs``: "fixed-shapes" runs the step in the fixed shapes a CUDA graph replays (on the
    CPU, as it is): the new key and value go to a column held in a tensor, attention reads every
    column with the later ones masked, and finished slots keep running; it must give the same
    logits. "replayed" also captures and replays it per layout (`FakeGraphs`)."""
    from rlvr.rollout.static_decode import GROW, StaticDecoder
    from rlvr.rollout.weights import FusedWeights

    monkeypatch.setattr(static_decode, "SHARE_FROM", 0)  # share even the tests' short prompts
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]  # 2, 19 and 4 tokens: left padding
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    cache, logits, mask_PT, _ = engine._prefill(prompts)
    n = 4
    fakes = FakeGraphs()
    decoder = StaticDecoder(tiny_model, FusedWeights(tiny_model), cache, mask_PT, n, fixed_shapes=graphs != "plain",
                            graphs=fakes if graphs == "replayed" else None)  # type: ignore[arg-type]
    rows = list(range(len(prompts) * n))  # which sample each running row is
    tokens: list[list[int]] = [[] for _ in rows]
    gen = torch.Generator().manual_seed(0)
    # (step, samples that finish there): 12 → 8 rows re-lays prompt rows of 3 slots (8 of 9 full);
    # 8 → 5 rows, 3 of them prompt 0's (9 slots for 5 rows), gives each running row its own
    leave = {3: [3, 6, 10, 11], 5: [4, 5, 8]}
    layouts = []
    for step in range(GROW + 6):
        if step in leave:
            idx = torch.tensor([i for i, r in enumerate(rows) if r not in leave[step]])
            decoder.keep(idx)
            rows = [r for r in rows if r not in leave[step]]
            layouts.append((len(decoder.neg_PW), decoder.n, bool(decoder.prompt_keys)))
        tok = torch.randint(3, 259, (len(rows),), generator=gen)
        for r, t in zip(rows, tok.tolist()):
            tokens[r].append(t)
        logits = decoder.step(tok)
        if step % 7 == 0 or step in leave or step >= GROW - 1:
            for row_logits, r in zip(logits, rows):
                ids = torch.tensor([prompts[r // n] + tokens[r]])
                torch.testing.assert_close(row_logits, tiny_model(input_ids=ids).logits[0, -1], atol=1e-4, rtol=0)
    # shared with 3 slots per prompt row, then a row each, the prompt joined to the row's buffers
    assert layouts == [(3, 3, True), (5, 1, False)]
    assert decoder.keys[0].shape[3] == max(map(len, prompts)) + 2 * GROW  # and they grew after the join
    if graphs == "replayed":  # captured on each of the 4 layouts (first, re-laid, joined, grown), replayed between
        assert fakes.captures == 4 and fakes.replays == GROW + 6 - 4, (fakes.captures, fakes.replays)


@torch.no_grad()
@torch.no_grad()
def test_steps_are_not_captured_where_a_graph_would_break(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """No capture for a rotary embedding that updates its frequencies on the host (dynamic
    scaling), nor while any module has a forward hook (a replay would skip it): such steps run
    in fixed shapes, uncaptured, and give the same logits."""
    from transformers import LlamaConfig

    from rlvr.rollout.static_decode import StaticDecoder, graphs_unsupported
    from rlvr.rollout.weights import FusedWeights

    assert graphs_unsupported(tiny_model) is None
    config = LlamaConfig(**{**tiny_model.config.to_dict(), "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                                                                "rope_theta": 10000.0}})
    dynamic = LlamaForCausalLM(config).eval()
    assert "dynamic" in str(graphs_unsupported(dynamic))
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    for model, hooked in ((dynamic, False), (tiny_model, True)):
        engine.model = model
        cache, _, mask_PT, _ = engine._prefill(prompts)
        fakes = FakeGraphs()
        decoder = StaticDecoder(model, FusedWeights(model), cache, mask_PT, 2, fixed_shapes=True,
                                graphs=fakes)  # type: ignore[arg-type]
        handle = model.model.norm.register_forward_hook(lambda *a: None) if hooked else None
        for _ in range(3):
            decoder.step(torch.tensor([5] * 6))
        if handle is not None:
            handle.remove()
        assert fakes.captures == 0


def test_static_decoder_shares_only_where_it_saves_enough_reads(tiny_model: Model, tiny_tokenizer: Tokenizer) -> None:
    """Prompt keys are shared when (n - 1) · prompts · width ≥ SHARE_FROM, else copied per sample."""
    from rlvr.rollout.static_decode import SHARE_FROM, StaticDecoder
    from rlvr.rollout.weights import FusedWeights

    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="static")
    short, wide = [1, 5, 7], [1, 5, 7] * (SHARE_FROM // 3 // 3 + 1)  # (4 - 1) · 1 · width below / above it
    for prompt, shared in ((short, False), (wide, True)):
        cache, _, mask_PT, _ = engine._prefill([prompt])
        decoder = StaticDecoder(tiny_model, FusedWeights(tiny_model), cache, mask_PT, 4)
        assert bool(decoder.prompt_keys) == shared and decoder.n == (4 if shared else 1)
        assert len(decoder.step(torch.tensor([9, 9, 9, 9]))) == 4


def test_a_stop_string_never_matches_inside_a_special_token(tiny_model: Model, tiny_tokenizer: Tokenizer,
                                                            decoder: str) -> None:
    """Special tokens are not in a completion's text, so they take no part in stop matching: a
    sampled <|im_start|> ended a completion on stop "im" or "_" (a red-team review, session 19)."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    x, a = encode(tiny_tokenizer, "xa")
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    with steer(tiny_model, {x: start, start: a, a: a}):
        out = engine.generate([encode(tiny_tokenizer, "x")], SamplingParams(temperature=0.0, max_new_tokens=4,
                                                                           stop=("im", "start", "|")))
    completion = out[0][0]
    assert completion.token_ids[:2] == (start, a) and completion.finish_reason == "length", completion
