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


def test_sliding_window_models_prefill_whole(tiny_tokenizer: PreTrainedTokenizerFast) -> None:
    """A sliding window counts cache columns, so the padding a split leaves between a row's
    prefix and its suffix would shrink the window: such models prefill whole (the split gives
    other logits, shown by forcing it)."""
    from transformers import MistralConfig, MistralForCausalLM

    from tests.tiny import BOS_ID, PAD_ID, VOCAB_SIZE

    torch.manual_seed(0)
    model = MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=4, initializer_range=0.2, pad_token_id=PAD_ID, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, attn_implementation="sdpa"))
    prompts = _multi_turn_prompts(tiny_tokenizer)
    engine = EmbeddedEngine(model, tiny_tokenizer, eos_token_ids=[EOS_ID], decoder="hf")
    assert not engine._share_prefixes
    _, logits_PV, mask_PT, _ = engine._prefill(prompts)
    whole_PV = engine._prefill_whole(prompts)[1]
    assert mask_PT.shape[1] == max(len(p) for p in prompts)
    torch.testing.assert_close(logits_PV, whole_PV, atol=0, rtol=0)
    engine._share_prefixes = True
    assert not torch.allclose(engine._prefill(prompts)[1], whole_PV, atol=1e-3)


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
        # the third call mixes sources of different widths: rows that extend stored prompts, and
        # new rows that share prefixes among themselves (a plan)
        new = [list(range(20, 40)) + [k] for k in range(3)]
        third = [s + [7, 8] for s in second] + [f + [8] for f in first[:2]] + new
        _, logits_PV, mask_PT, _ = engine._prefill(third)
        torch.testing.assert_close(logits_PV, engine._prefill_whole(third)[1], atol=1e-4, rtol=0)
        assert mask_PT.shape[1] == max(len(p) for p in third)  # the padding between prefix and suffix closed up
        fourth = [t + [5] for t in third]
        for prompt, group in zip(fourth, engine.generate(fourth, params)):
            torch.testing.assert_close(torch.tensor(group[0].logprobs),
                                       recompute_logprobs(tiny_model, prompt, group[0], params), atol=1e-4, rtol=0)
    assert engine._store is None  # emptied on leaving


def test_the_store_hands_a_prompt_out_once_and_drops_what_lies_idle() -> None:
    from rlvr.rollout import prefixes

    def tensors(rows: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        return [torch.zeros(rows, 1, 3, 2)], [torch.zeros(rows, 1, 3, 2)], torch.ones(rows, 3, dtype=torch.long)

    store = prefixes.PrefixStore()
    store.put([[1, 2, 3], [1, 2, 4]], *tensors(2))
    hit = store.take([1, 2, 3, 9])
    assert hit is not None and (hit.row, hit.length) == (0, 3)
    assert store.take([1, 2, 3, 9]) is None  # handed out once
    assert store.take([1, 2, 4]) is None  # a prompt is not its own proper prefix
    for _ in range(prefixes.IDLE_CALLS):
        store.put([[7, 7, 7]], *tensors(1))
    assert store.take([1, 2, 4, 5]) is None  # its batch lay idle for IDLE_CALLS calls
    small = prefixes.PrefixStore(budget_bytes=80)  # one row: keys and values, 2 × 6 floats = 48 bytes
    small.put([[1, 2, 3]], *tensors(1))
    small.put([[4, 5, 6]], *tensors(1))
    assert small.take([1, 2, 3, 0]) is None and small.take([4, 5, 6, 0]) is not None  # the oldest went first
    small.put([[1, 2, 3], [4, 5, 6], [7, 8, 9]], *tensors(3))  # 144 bytes: not kept at all
    assert small.take([7, 8, 9, 0]) is None


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
