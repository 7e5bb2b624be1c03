"""Shared-prefix prefill (rlvr.rollout.prefixes, EmbeddedEngine._prefill): which prompts share
what, and that a prefill through shared prefixes samples what prefilling each prompt whole does.

The engine checks recompute every sampled token's log-probability from one forward pass over the
prompt and the tokens (no cache, no padding), as tests/test_engine.py does: a prefix row given to
the wrong prompt, a position counted across the padding between prefix and suffix, or a suffix
cut one token off would each move them by far more than fp32 summation order (~1e-6).
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.prefixes import plan_prefixes
from rlvr.types import SamplingParams
from tests.test_engine_contract import recompute_logprobs, reference_greedy
from tests.tiny import EOS_ID


def test_a_group_of_equal_prompts_shares_all_but_its_last_token() -> None:
    a, b = list(range(10, 30)), list(range(40, 60))
    plan = plan_prefixes([a, b, a, b, a, b])
    assert plan is not None
    assert sorted(map(tuple, plan.prefixes)) == [tuple(a[:-1]), tuple(b[:-1])]
    assert [plan.prefixes[o] for o in plan.owner] == [a[:-1], b[:-1]] * 3
    assert all(plan.cut(i) == 19 for i in range(6))


def test_episodes_share_their_prompt_not_only_a_common_header() -> None:
    """Two groups whose prompts begin with the same 5-token header: sharing the header across
    all four saves 3·5 = 15 tokens, sharing each group's 20-token prompt 2·20 = 40."""
    header = [1, 2, 3, 4, 5]
    p, q = header + list(range(100, 115)), header + list(range(200, 215))
    prompts = [p + [7, 8], p + [9], q + [7], q + [8, 9, 10]]
    plan = plan_prefixes(prompts)
    assert plan is not None
    assert [plan.prefixes[o] for o in plan.owner] == [p, p, q, q]
    assert [prompts[i][plan.cut(i):] for i in range(4)] == [[7, 8], [9], [7], [8, 9, 10]]


def test_no_plan_where_sharing_would_not_pay() -> None:
    assert plan_prefixes([[1, 2, 3]]) is None  # one prompt
    assert plan_prefixes([[1, 2, 3], [4, 5, 6]]) is None  # nothing in common
    # a 2-token common start against 30-token prompts: less than a quarter saved
    assert plan_prefixes([[1, 2] + [3] * 28, [1, 2] + [4] * 28]) is None
    # a prompt of one token cannot give a prefix (its last token is its suffix)
    assert plan_prefixes([[9], [9], [9]]) is None


def test_a_long_prompt_apart_does_not_stop_the_others_sharing() -> None:
    shared = list(range(1, 41))
    prompts = [shared + [50], shared + [51, 52], shared + [53], list(range(60, 70))]
    plan = plan_prefixes(prompts)
    assert plan is not None
    assert [plan.cut(i) for i in range(4)] == [40, 40, 40, 9]


def _multi_turn_prompts(tokenizer: PreTrainedTokenizerFast) -> list[list[int]]:
    """Three groups' contexts at a later turn: each group's prompt, then histories of different
    lengths (so prefixes and suffixes are both left-padded, leaving padding inside the rows)."""
    bases = [tokenizer.encode(t, add_special_tokens=False) for t in
             ("The quick brown fox jumps over the lazy dog again and again",
              "hi there",
              "a, b, c, d, e, f, g, h, i, j, k, l, m, n")]
    tails = [[], [5, 9], [7, 7, 7, 7, 7, 7], [11]]
    return [base + tail for base in bases for tail in tails]


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_shared_prefill_samples_what_a_whole_prefill_samples(
        decoder: str, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    prompts = _multi_turn_prompts(tiny_tokenizer)
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    assert plan_prefixes(prompts) is not None  # the check below runs through shared prefixes
    _, logits_PV, mask_PT, _ = engine._prefill(prompts)
    _, whole_PV, _, _ = engine._prefill_whole(prompts)
    assert (mask_PT.sum(-1) == torch.tensor([len(p) for p in prompts])).all()
    torch.testing.assert_close(logits_PV, whole_PV, atol=1e-4, rtol=0)

    params = SamplingParams(temperature=1.0, max_new_tokens=6, n=2)
    for prompt, group in zip(prompts, engine.generate(prompts, params)):
        for c in group:
            torch.testing.assert_close(torch.tensor(c.logprobs), recompute_logprobs(tiny_model, prompt, c, params),
                                       atol=1e-4, rtol=0)
    greedy = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert [list(g[0].token_ids) for g in greedy] == [reference_greedy(tiny_model, p, 6) for p in prompts]


def test_models_whose_cache_is_not_plain_prefill_whole(
        tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache with other layers (sliding windows) is not split: the engine goes back to whole
    prompts, and stays there."""
    from rlvr.rollout import engine as engine_module

    class OtherLayer:  # stands for any layer type the split was not written for
        pass

    monkeypatch.setattr(engine_module, "DynamicLayer", OtherLayer)
    prompts = _multi_turn_prompts(tiny_tokenizer)
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="hf")
    _, logits_PV, mask_PT, _ = engine._prefill(prompts)
    assert not engine._share_prefixes
    assert mask_PT.shape[1] == max(len(p) for p in prompts)  # one left-padded block: no split
    torch.testing.assert_close(logits_PV, engine._prefill_whole(prompts)[1], atol=0, rtol=0)


@pytest.mark.parametrize("decoder", ["static", "hf"])
def test_turns_that_extend_stored_prompts_sample_what_whole_prefills_sample(
        decoder: str, tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """Inside `reusing_prefixes` a second call's prompts, the first call's plus a sampled action
    and an observation, start from the stored keys and values and encode only what is new."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder=decoder)
    first = _multi_turn_prompts(tiny_tokenizer)
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    encoded: list[int] = []
    forward = tiny_model.forward

    def counting(*args, **kwargs):  # tokens each forward encodes
        encoded.append(int(kwargs["input_ids"].numel()))
        return forward(*args, **kwargs)

    with engine.reusing_prefixes():
        out = engine.generate(first, params)
        second = [p + list(g[0].token_ids) + [9] * (i % 3 + 1) for i, (p, g) in enumerate(zip(first, out))]
        tiny_model.forward = counting  # type: ignore[method-assign]
        try:
            _, logits_PV, _, _ = engine._prefill(second)
        finally:
            del tiny_model.forward
        assert encoded[0] == len(second) * max(len(s) - len(f) for s, f in zip(second, first))  # only what is new
        torch.testing.assert_close(logits_PV, engine._prefill_whole(second)[1], atol=1e-4, rtol=0)
        third = [s + [7, 8] for s in second]
        for prompt, group in zip(third, engine.generate(third, params)):
            torch.testing.assert_close(torch.tensor(group[0].logprobs),
                                       recompute_logprobs(tiny_model, prompt, group[0], params), atol=1e-4, rtol=0)
    assert engine._store is None  # emptied on leaving


def test_changed_weights_invalidate_what_is_stored(
        tiny_model: LlamaForCausalLM, tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """Keys and values computed by the old weights must not reach a prefill under the new ones."""
    engine = EmbeddedEngine(tiny_model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="hf")
    prompts = [tiny_tokenizer.encode("hi there you", add_special_tokens=False), [5, 6, 7, 8]]
    longer = [p + [9, 9] for p in prompts]
    with engine.reusing_prefixes():
        engine._prefill(prompts)
        with torch.no_grad():
            for p in tiny_model.parameters():
                p.mul_(1.5)
        _, logits_PV, _, _ = engine._prefill(longer)
        torch.testing.assert_close(logits_PV, engine._prefill_whole(longer)[1], atol=1e-4, rtol=0)
