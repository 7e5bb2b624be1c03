"""rlvr.rollout.sampling: the processed distribution by hand, and sampled draws against it."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.rollout.sampling import process_logits, sample_tokens

NEG_INF = float("-inf")


def probs(logprobs: torch.Tensor) -> list[float]:
    return logprobs.exp().tolist()


def test_temperature_scales_logits() -> None:
    # logits [2, 1, 0] at T = 0.5 are [4, 2, 0]: p = e^[4, 2, 0] / (e^4 + e^2 + 1)
    z = math.e**4 + math.e**2 + 1
    out = process_logits(torch.tensor([[2.0, 1.0, 0.0]]), temperature=0.5)
    assert out.dtype == torch.float32
    assert probs(out[0]) == pytest.approx([math.e**4 / z, math.e**2 / z, 1 / z], abs=1e-6)
    # T = 1 is plain softmax: e^[2, 1, 0] / (e^2 + e + 1)
    z1 = math.e**2 + math.e + 1
    out1 = process_logits(torch.tensor([[2.0, 1.0, 0.0]]), temperature=1.0)
    assert probs(out1[0]) == pytest.approx([math.e**2 / z1, math.e / z1, 1 / z1], abs=1e-6)


def test_top_k_keeps_k_largest_and_renormalises() -> None:
    # logits [0, 3, 1, 2] with top_k = 2 keep tokens 1 (3) and 3 (2): p = [e^3, e^2] / (e^3 + e^2)
    out = process_logits(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), temperature=1.0, top_k=2)
    assert out[0, 0] == NEG_INF and out[0, 2] == NEG_INF
    p1 = math.e**3 / (math.e**3 + math.e**2)
    assert probs(out[0]) == pytest.approx([0.0, p1, 0.0, 1 - p1], abs=1e-6)
    # top_k = 0 and top_k >= V keep everything
    for k in (0, 4, 10):
        assert torch.isfinite(process_logits(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), temperature=1.0, top_k=k)).all()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    # p = [0.05, 0.5, 0.15, 0.3]; sorted 0.5, 0.3, 0.15, 0.05 with mass before each 0, .5, .8, .95.
    # top_p = 0.75: 0.5 + 0.3 reaches it, so keep tokens 1 and 3, renormalised: [0.625, 0.375].
    logits = torch.tensor([[0.05, 0.5, 0.15, 0.3]]).log()
    out = process_logits(logits, temperature=1.0, top_p=0.75)
    assert probs(out[0]) == pytest.approx([0.0, 0.625, 0.0, 0.375], abs=1e-6)
    # top_p = 0.4: the most likely token alone (0.5) reaches it.
    out = process_logits(logits, temperature=1.0, top_p=0.4)
    assert probs(out[0]) == pytest.approx([0.0, 1.0, 0.0, 0.0], abs=1e-6)
    # top_p = 0.9: 0.5 + 0.3 = 0.8 < 0.9, so 0.15 joins: [0, .5, .15, .3] / 0.95.
    out = process_logits(logits, temperature=1.0, top_p=0.9)
    assert probs(out[0]) == pytest.approx([0.0, 0.5 / 0.95, 0.15 / 0.95, 0.3 / 0.95], abs=1e-6)
    # Boundary: four equal logits give exactly 0.25 each; top_p = 0.5 is reached by two tokens
    # exactly, so the third (mass before it = 0.5) is dropped. Which two of the tied four stay
    # is the sort's business.
    out = process_logits(torch.zeros(1, 4), temperature=1.0, top_p=0.5)
    assert sorted(probs(out[0])) == pytest.approx([0.0, 0.0, 0.5, 0.5], abs=1e-6)


def test_top_p_applies_after_temperature_and_top_k_per_row() -> None:
    # Row 0: logits log[0.1, 0.2, 0.3, 0.4] at T = 1, top_k = 3 → [0, .2, .3, .4] / .9 = [0, 2/9, 1/3, 4/9];
    # mass before each in sorted order (4/9, 1/3, 2/9): 0, 4/9, 7/9 → top_p = 0.7 keeps 4/9 and 1/3:
    # renormalised [0, 0, 3/7, 4/7].
    # Row 1: p = [.5, .5, ~0, ~0]; top_k = 3 keeps both ~0 tokens (ties at the k-th value stay),
    # and 0.5 alone does not reach 0.7, so top_p keeps the two halves: [.5, .5, 0, 0].
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 1e-9, 1e-9]]).log()
    out = process_logits(logits, temperature=1.0, top_k=3, top_p=0.7)
    assert probs(out[0]) == pytest.approx([0.0, 0.0, 3 / 7, 4 / 7], abs=1e-6)
    assert probs(out[1]) == pytest.approx([0.5, 0.5, 0.0, 0.0], abs=1e-6)
    # Temperature sharpens before top_p: at T = 0.5, p ∝ [.01, .04, .09, .16] / .30 →
    # sorted .5333, .3, .1333: mass before .3 is .5333 < .7, before .1333 is .8333 ≥ .7 → keep two.
    out = process_logits(logits[:1], temperature=0.5, top_p=0.7)
    assert probs(out[0]) == pytest.approx([0.0, 0.0, 9 / 25, 16 / 25], abs=1e-6)


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0], [3.0, 2.9, 0.0], [-5.0, -4.0, -4.5]])
    tokens, logprobs = sample_tokens(logits, temperature=0.0)
    assert tokens.tolist() == [1, 0, 1]
    # temperature 0 applies no scaling: the logprob reported is that of softmax(logits)
    torch.testing.assert_close(logprobs, logits.log_softmax(-1).gather(-1, tokens[:, None]).squeeze(-1))
    # greedy ignores the generator and top_k/top_p only narrow the set around the argmax
    tokens_k, _ = sample_tokens(logits, temperature=0.0, top_k=2, top_p=0.5)
    assert tokens_k.tolist() == [1, 0, 1]


def test_sample_tokens_returns_logprob_under_processed_distribution() -> None:
    # logits [2, 1, 0, -1], T = 1, top_k = 2 → p = [e/(e+1), 1/(e+1), 0, 0] = [0.7311, 0.2689, 0, 0]
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(64, 1)
    gen = torch.Generator().manual_seed(0)
    tokens, logprobs = sample_tokens(logits, temperature=1.0, top_k=2, generator=gen)
    expected = {0: math.log(math.e / (math.e + 1)), 1: math.log(1 / (math.e + 1))}
    assert set(tokens.tolist()) == {0, 1}
    for t, lp in zip(tokens.tolist(), logprobs.tolist()):
        assert lp == pytest.approx(expected[t], abs=1e-6)
    # the same at T = 2 with top_p: [1, .5, 0, -.5] → softmax, then compare with process_logits
    tokens, logprobs = sample_tokens(logits, temperature=2.0, top_p=0.8, generator=gen)
    processed = process_logits(logits, temperature=2.0, top_p=0.8)
    torch.testing.assert_close(logprobs, processed.gather(-1, tokens[:, None]).squeeze(-1))
    assert torch.isfinite(logprobs).all()


@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_draw_frequencies_match_softmax(temperature: float) -> None:
    n = 20_000
    logits = torch.tensor([1.0, 0.0, -1.0])
    gen = torch.Generator().manual_seed(1234)
    tokens, _ = sample_tokens(logits.repeat(n, 1), temperature=temperature, generator=gen)
    freq = torch.bincount(tokens, minlength=3).double() / n
    p = (logits.double() / temperature).softmax(-1)  # T=1: [.665, .245, .090]; T=2: [.506, .307, .186]
    sigma = (p * (1 - p) / n).sqrt()  # ≈ 0.0033: 4σ ≈ 0.013, far below any wrong noise formula's error
    assert ((freq - p).abs() < 4 * sigma).all(), (freq, p)


def test_zero_probability_tokens_between_others_are_never_drawn() -> None:
    # p = [.25, 0, .5, 0, .25]: cumulative [.25, .25, .75, .75, 1]; an off-by-one in the inverse
    # CDF would draw the zero-probability tokens at the cumulative boundaries
    n = 20_000
    logits = torch.tensor([0.0, float("-inf"), 0.6931471805599453, float("-inf"), 0.0]).repeat(n, 1)
    tokens, logprobs = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=5).double() / n
    assert freq[1] == 0 and freq[3] == 0
    assert (freq - torch.tensor([0.25, 0, 0.5, 0, 0.25], dtype=torch.float64)).abs().max() < 0.015  # 4σ ≈ 0.014
    assert torch.isfinite(logprobs).all()


def test_tokens_outside_top_k_and_top_p_are_never_drawn() -> None:
    n = 4_000
    logits = torch.tensor([[0.5, 0.4, 0.3, 0.2, 0.1]]).repeat(n, 1)  # nearly flat: all 5 likely without top_k
    gen = torch.Generator().manual_seed(0)
    tokens, _ = sample_tokens(logits, temperature=1.0, top_k=2, generator=gen)
    assert set(tokens.tolist()) == {0, 1}
    # p ∝ e^[.5, .4, .3, .2, .1] ≈ [.244, .220, .199, .180, .163]; top_p = 0.6: mass before the 4th is .663
    tokens, _ = sample_tokens(logits, temperature=1.0, top_p=0.6, generator=gen)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_same_generator_seed_same_draws() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    a, _ = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b, _ = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c, _ = sample_tokens(logits, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_a_tiny_temperature_is_all_but_greedy_not_nan() -> None:
    """logits / 1e-38 overflowed to inf and inf - inf = nan: `rlvr serve` answered 500 to
    temperature 1e-38 (a red-team review, session 19)."""
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, 0.5, -1.0]])
    for temperature in (1e-38, 1e-45, 1e-6):
        logprobs = process_logits(logits, temperature=temperature)
        assert torch.isfinite(logprobs.max(-1).values).all()
        tokens, chosen = sample_tokens(logits, temperature=temperature, uniforms_B=torch.tensor([0.3, 0.7], dtype=torch.float64))
        assert tokens[0] == 1 and tokens[1] in (0, 1) and torch.isfinite(chosen).all()
    assert torch.allclose(process_logits(logits, temperature=0.5), (logits / 0.5).log_softmax(-1))
