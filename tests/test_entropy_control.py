"""Clip-Cov, KL-Cov and the high-entropy token selection (rlvr.algos.entropy_control), on
hand-computed values; the comparison with verl's code is bench/verl_oracle.py."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.algos.entropy_control import clip_cov_loss, high_entropy_tokens, kl_cov_loss, token_covariance
from rlvr.algos.inputs import LossInputs

F64 = torch.float64


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


# One row of four trained tokens (and a padded fifth, with garbage that must not leak).
# mean log π = (-0.1 - 2 - 1 - 1) / 4 = -1.025; mean A = (2 - 0.5 + 0 + 0) / 4 = 0.375
# cov = (0.925 · 1.625, -0.975 · -0.875, 0.025 · -0.375, 0.025 · -0.375)
#     = (1.503125, 0.853125, -0.009375, -0.009375): only token 0 lies in (1, 5).
LOGPROBS = [[-0.1, -2.0, -1.0, -1.0, float("nan")]]
ADVANTAGES = [[2.0, -0.5, 0.0, 0.0, 1e6]]
MASK = [[1, 1, 1, 1, 0]]


def test_token_covariance_is_the_centred_product_over_trained_tokens() -> None:
    cov = token_covariance(t(LOGPROBS), t(ADVANTAGES), t(MASK))
    torch.testing.assert_close(cov[0, :4], t([1.503125, 0.853125, -0.009375, -0.009375]), atol=1e-12, rtol=0)
    assert cov[0, 4] == float("-inf")


def test_clip_cov_cuts_the_gradient_of_the_high_covariance_token_only() -> None:
    logprobs = t(LOGPROBS).requires_grad_()
    # clip_ratio·N = 0.25·4 = 1 token chosen
    loss, metrics = clip_cov_loss(LossInputs(logprobs, t(LOGPROBS).nan_to_num(0.0), t(ADVANTAGES), t(MASK)),
                                  clip_ratio=0.25)
    # on-policy, ratio 1: loss_t = -A_t, except token 0, chosen (the only candidate)
    torch.testing.assert_close(loss, t([[0.0, 0.5, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, t([[0.0, 0.5, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0)  # d(-A·r)/dlogπ = -A·r
    assert float(metrics["cov_clipped_fraction"]) == pytest.approx(0.25)


def test_clip_cov_leaves_tokens_ppo_already_clipped_and_chooses_ratio_n_of_the_rest() -> None:
    # token 0's ratio is e^0.5 > 1.2 with A > 0: a clip of 0.2 holds it, so it is no candidate
    old = t([[-0.6, -2.0, -1.0, -1.0, 0.0]])
    loss, metrics = clip_cov_loss(LossInputs(t(LOGPROBS), old, t(ADVANTAGES), t(MASK)), clip_low=0.2, clip_high=0.2)
    torch.testing.assert_close(loss, t([[-2.0 * 1.2, 0.5, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0)
    assert float(metrics["cov_clipped_fraction"]) == 0.0 and float(metrics["clip_fraction"]) == 0.25
    # the authors' recipe clips the ratio to [0, 2] (clip_low = clip_high = 1): e^0.5 is inside,
    # so token 0 (covariance 1.503 as above, ratio aside) is the one candidate and is cut
    loss, metrics = clip_cov_loss(LossInputs(t(LOGPROBS), old, t(ADVANTAGES), t(MASK)), clip_ratio=0.25)
    torch.testing.assert_close(loss, t([[0.0, 0.5, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0)
    assert float(metrics["clip_fraction"]) == 0.0 and float(metrics["cov_clipped_fraction"]) == 0.25
    old = t([[-1.2, -2.0, -1.0, -1.0, 0.0]])  # ratio e^1.1 > 2: clipped even there
    loss, metrics = clip_cov_loss(LossInputs(t(LOGPROBS), old, t(ADVANTAGES), t(MASK)), clip_ratio=0.25)
    torch.testing.assert_close(loss, t([[-2.0 * 2.0, 0.5, 0.0, 0.0, 0.0]]), atol=1e-12, rtol=0)
    # 40 rows like the first: 40 candidates, clip_ratio 0.05 of 160 tokens chooses 8
    rows = 40
    torch.manual_seed(0)
    loss, metrics = clip_cov_loss(LossInputs(t(LOGPROBS * rows), t(LOGPROBS * rows).nan_to_num(0.0),
                                             t(ADVANTAGES * rows), t(MASK * rows)), clip_ratio=0.05)
    assert int((loss[:, 0] == 0).sum()) == 8 and bool((loss[:, 1] == 0.5).all())


def test_clip_cov_chooses_its_ratio_of_tokens_however_the_batch_is_cut() -> None:
    """Clip-Cov's count is clip_ratio·N in expectation per pass, so cutting a batch into micro-
    batches does not change how many tokens it chooses (issue 50, bug 3: max(1, ⌊r·N⌋) chose at
    least one in every pass, 64 of 2,048 tokens here where the ratio asks for 20.48). 64 rows of
    32 tokens, every token a candidate: log π and A are ±1 about their means in every row, so each
    centred product is exactly 1, inside (0.5, 2)."""
    from rlvr.algos.entropy_control import chosen_count

    signs = t([[1.0, -1.0] * 16] * 64)
    logprobs, advantages, mask = -2.0 + signs, signs, torch.ones(64, 32, dtype=F64)
    ratio, seeds = 0.01, 100

    def chosen(rows_per_pass: int) -> list[int]:
        counts = []
        for seed in range(seeds):
            torch.manual_seed(seed)
            total = 0
            for start in range(0, 64, rows_per_pass):
                part = slice(start, start + rows_per_pass)
                _, metrics = clip_cov_loss(LossInputs(logprobs[part], logprobs[part], advantages[part], mask[part]),
                                           clip_ratio=ratio, cov_low=0.5, cov_high=2.0)
                total += round(float(metrics["cov_clipped_fraction"]) * 32 * len(range(64)[part]))
            counts.append(total)
        return counts

    expected = ratio * 64 * 32  # 20.48
    whole = chosen(64)
    assert set(whole) == {20, 21}  # one pass: ⌊20.48⌋ or one more
    assert abs(sum(whole) / seeds - expected) < 4 * math.sqrt(0.48 * 0.52 / seeds)
    for rows in (1, 8):  # each pass expects 0.32 or 2.56 tokens; 64 or 8 passes
        counts = chosen(rows)
        p = ratio * 32 * rows % 1
        sd = math.sqrt(64 // rows * p * (1 - p) / seeds)  # of the mean over the seeds
        assert abs(sum(counts) / seeds - expected) < 4 * sd, (rows, sum(counts) / seeds)
    # the count alone: exact for a whole number, never rounded up from zero
    assert chosen_count(3.0) == 3 and chosen_count(0.0) == 0


def test_kl_cov_penalises_the_largest_covariance_tokens_without_clipping() -> None:
    old = t([[-0.2, -1.9, -1.0, -1.0, 0.0]])  # log r = (0.1, -0.1, 0, 0)
    logprobs = t(LOGPROBS).requires_grad_()
    loss, metrics = kl_cov_loss(LossInputs(logprobs, old, t(ADVANTAGES), t(MASK)), kl_ratio=0.25, kl_coef=1.0)
    # one token (0.25 · 4) of largest covariance: token 0, which also gets + |log r|
    expected = [[-2.0 * math.exp(0.1) + 0.1, 0.5 * math.exp(-0.1), 0.0, 0.0, 0.0]]
    torch.testing.assert_close(loss, t(expected), atol=1e-12, rtol=0)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, t([[-2.0 * math.exp(0.1) + 1.0, 0.5 * math.exp(-0.1), 0.0, 0.0, 0.0]]),
                               atol=1e-12, rtol=0)
    assert float(metrics["cov_penalised_fraction"]) == 0.25
    # kl_coef 0: the plain unclipped surrogate, whatever the ratio
    loss, _ = kl_cov_loss(LossInputs(t(LOGPROBS), old - 5.0, t(ADVANTAGES), t(MASK)), kl_coef=0.0)
    torch.testing.assert_close(loss[0, :2], t([-2.0 * math.exp(5.1), 0.5 * math.exp(4.9)]), rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_fn", [clip_cov_loss, kl_cov_loss])
def test_equal_rewards_give_zero_and_an_empty_batch_is_fine(loss_fn) -> None:  # type: ignore[no-untyped-def]
    """On-policy (ratio 1) with zero advantages, no loss and no gradient. (Off-policy, KL-Cov's
    |log r| still holds its chosen token back: a trust region, whatever the advantage.)"""
    logprobs = t(LOGPROBS).nan_to_num(0.0).requires_grad_()
    loss, _ = loss_fn(LossInputs(logprobs, logprobs.detach(), torch.zeros(1, 5, dtype=F64), t(MASK)))
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    assert float(loss.detach().abs().sum()) == 0.0 and float(grad.abs().sum()) == 0.0
    loss, _ = loss_fn(LossInputs(logprobs, logprobs.detach(), t(ADVANTAGES), torch.zeros(1, 5)))
    assert float(loss.detach().abs().sum()) == 0.0


def test_bad_settings_are_refused() -> None:
    x = LossInputs(t(LOGPROBS), t(LOGPROBS), t(ADVANTAGES), t(MASK))
    with pytest.raises(ValueError, match="clip_ratio"):
        clip_cov_loss(x, clip_ratio=0.0)
    with pytest.raises(ValueError, match="cov_low"):
        clip_cov_loss(x, cov_low=5.0, cov_high=1.0)
    with pytest.raises(ValueError, match="kl_ratio"):
        kl_cov_loss(x, kl_ratio=2.0)
    with pytest.raises(ValueError, match="top"):
        high_entropy_tokens(t(LOGPROBS), t(MASK), 0.0)


def test_high_entropy_tokens_keep_the_top_fraction_of_trained_tokens() -> None:
    entropy = t([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    mask = t([[1, 1, 1], [1, 1, 0]])  # 100 is padding: not a trained token, not in the quantile
    # quantile 0.6 of (1, 2, 3, 4, 5) = 1 + 0.6 · 4 = 3.4: tokens 4 and 5 (40%)
    assert high_entropy_tokens(entropy, mask, 0.4).tolist() == [[False, False, False], [True, True, False]]
    assert high_entropy_tokens(entropy, mask, 1.0).tolist() == mask.bool().tolist()
    # ties at the threshold all stay
    assert int(high_entropy_tokens(torch.ones(2, 3), torch.ones(2, 3), 0.2).sum()) == 6


def test_kl_cov_with_one_step_per_batch_says_it_trains_as_the_policy_gradient(
        caplog: pytest.LogCaptureFixture) -> None:
    """On-policy (ρ = 1) KL-Cov's |log ρ| term and its gradient are zero: a config with one
    optimizer step per batch is told so, one with two mini-batches is not."""
    from rlvr.config import load_config
    from rlvr.train.settings import settings_from_config

    logprobs = t(LOGPROBS).nan_to_num(0.0).requires_grad_()
    loss, _ = kl_cov_loss(LossInputs(logprobs, logprobs.detach(), t(ADVANTAGES), t(MASK)), kl_ratio=1.0, kl_coef=1.0)
    (grad,) = torch.autograd.grad(loss.sum(), logprobs)
    torch.testing.assert_close(grad, -t(ADVANTAGES) * t(MASK), atol=1e-12, rtol=0)  # every token penalised, none moved
    with caplog.at_level("WARNING", logger="rlvr.train"):
        settings_from_config(load_config(None, ['algo.loss="kl_cov"']), [])
    assert "trains as the plain policy gradient" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rlvr.train"):
        settings_from_config(load_config(None, ['algo.loss="kl_cov"', "train.mini_batches=2"]), [])
    assert "plain policy gradient" not in caplog.text


@pytest.mark.parametrize("name", sorted(__import__("rlvr.algos.losses", fromlist=["LOSSES"]).LOSSES))
def test_high_entropy_selection_keeps_every_other_token_out_of_every_loss(name: str) -> None:
    """algo.entropy = {top = 0.2} on one row of five trained tokens: only the highest-entropy token
    (the third) gets a gradient, whatever the loss. A sequence-level loss (GMPO, GSPO) takes its
    row statistic over the selected token; zeroing its loss afterwards had left GMPO's -0.041 on
    all five tokens (issue 50, bug 2). The old policy differs, so ratio-dependent terms are live."""
    from rlvr.train.settings import LossSettings, UpdateSettings
    from rlvr.train.update import policy_loss

    logprobs = t([[-0.5, -1.0, -1.5, -0.7, -2.0]]).requires_grad_()
    old = t([[-0.6, -0.9, -1.4, -0.8, -1.9]])
    advantages = t([[1.0] * 5])
    mask = torch.ones(1, 5, dtype=torch.bool)
    entropy = t([[0.1, 0.2, 3.0, 0.3, 0.4]])
    x = LossInputs(logprobs, old, advantages, mask, entropy=entropy, correct=t([[1.0] * 5]),
                   group_accuracy=t([[0.5] * 5]), offpolicy=t([[0.0] * 5]), state={})
    s = UpdateSettings(loss=LossSettings(name=name, entropy_top=0.2))
    loss_BT, _ = policy_loss(s, x)
    (grad,) = torch.autograd.grad(loss_BT.sum(), logprobs)
    assert grad[0, 2] != 0, name
    assert grad[0, [0, 1, 3, 4]].abs().max() == 0, (name, grad)
    assert loss_BT[0, [0, 1, 3, 4]].abs().max() == 0
    # every token trained: every token gets one
    (every,) = torch.autograd.grad(policy_loss(UpdateSettings(loss=LossSettings(name=name)), x)[0].sum(), logprobs)
    assert (every != 0).all(), (name, every)
