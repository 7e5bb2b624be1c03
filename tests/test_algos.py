"""Hand-computed tests for rlvr.algos: advantages, KL estimators, PPO loss, aggregation."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlvr.algos import (
    AGGREGATIONS,
    DIVERGENCES,
    ESTIMATORS,
    KL_ESTIMATORS,
    LOSSES,
    aggregate_loss,
    group_advantages,
    ppo_clip_loss,
)
from rlvr.algos.inputs import LossInputs

F64 = torch.float64


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def close(actual: torch.Tensor, expected: object, atol: float = 1e-9) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=atol, rtol=0)


def test_registries() -> None:
    assert ESTIMATORS["grpo"] is group_advantages
    assert set(ESTIMATORS) == {"grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "bnpo", "remax", "stratified",
                               "global_pool", "rft"}
    assert LOSSES["ppo_clip"] is ppo_clip_loss
    assert set(LOSSES) == {"ppo_clip", "pg", "cispo", "gspo", "topr", "opmd", "bapo", "rec", "r2vpo", "nft", "luffy",
                            "sapo", "gmpo", "clip_cov", "kl_cov"}
    assert set(KL_ESTIMATORS) == {"k1", "k2", "k3", "k3_ratio"}
    assert set(DIVERGENCES) == {"forward_kl", "js"}
    assert AGGREGATIONS == ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


# --- advantages ------------------------------------------------------------------------


def test_group_advantages_std_normalised() -> None:
    rewards_PG = t([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    advantages_PG = group_advantages(rewards_PG)
    # group 0: mean .5, centred [.5, -.5, -.5, .5]; unbiased var = 4 * .25 / 3 = 1/3,
    #   std = 0.5773503; A = .5 / (0.5773503 + 1e-6) = 0.8660239 (biased std .5 would give 1)
    a0 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    # group 1: mean 2, centred [1, -1, 0, 0]; unbiased var = 2 / 3, std = 0.8164966;
    #   A = 1 / (0.8164966 + 1e-6) = 1.2247434
    a1 = 1.0 / (math.sqrt(2 / 3) + 1e-6)
    close(advantages_PG, [[a0, -a0, -a0, a0], [a1, -a1, 0.0, 0.0]])
    close(advantages_PG[0, 0], 0.8660239, atol=1e-7)


def test_group_advantages_dr_grpo_no_std() -> None:
    rewards_PG = t([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    # centred only: group means .5 and 2
    close(
        group_advantages(rewards_PG, normalize_std=False),
        [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]],
    )


@pytest.mark.parametrize("normalize_std", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_group_advantages_equal_rewards_are_exactly_zero(
    normalize_std: bool, dtype: torch.dtype
) -> None:
    # 0.1 is not representable: the group mean rounds, leaving a residue that /eps would inflate
    groups = [[[0.1, 0.1, 0.1], [1.0, 1.0, 1.0]], [[0.7], [1.0]]]  # G = 3 and G = 1
    for rewards in groups:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch.std warns on G = 1 (degrees of freedom <= 0)
            advantages_PG = group_advantages(
                torch.tensor(rewards, dtype=dtype), normalize_std=normalize_std
            )
        assert torch.equal(advantages_PG, torch.zeros(len(rewards), len(rewards[0]), dtype=dtype))


def test_group_advantages_rejects_wrong_rank() -> None:
    with pytest.raises(ValueError, match="rewards_PG"):
        group_advantages(t([1.0, 0.0]))


# --- KL estimators -----------------------------------------------------------------------

# columns: log pi - log pi_ref = d = 1, -1, 0
LOGPROBS = [[-1.0, -2.0, -0.5]]
REF_LOGPROBS = [[-2.0, -1.0, -0.5]]


def test_kl_estimators_values() -> None:
    logprobs_BT, ref_logprobs_BT = t(LOGPROBS), t(REF_LOGPROBS)
    e = math.e
    # k1 = d
    close(KL_ESTIMATORS["k1"](logprobs_BT, ref_logprobs_BT), [[1.0, -1.0, 0.0]])
    # k2 = d^2 / 2
    close(KL_ESTIMATORS["k2"](logprobs_BT, ref_logprobs_BT), [[0.5, 0.5, 0.0]])
    # k3 = exp(-d) + d - 1: d = 1 -> e^-1 = 0.3678794; d = -1 -> e - 2 = 0.7182818; d = 0 -> 0
    close(KL_ESTIMATORS["k3"](logprobs_BT, ref_logprobs_BT), [[1 / e, e - 2.0, 0.0]])


def test_kl_k3_nonnegative_and_zero_when_equal() -> None:
    generator = torch.Generator().manual_seed(0)
    logprobs_BT = -torch.rand(8, 16, generator=generator, dtype=F64) * 5
    ref_logprobs_BT = -torch.rand(8, 16, generator=generator, dtype=F64) * 5
    assert (KL_ESTIMATORS["k3"](logprobs_BT, ref_logprobs_BT) >= 0).all()
    assert torch.equal(KL_ESTIMATORS["k3"](logprobs_BT, logprobs_BT), torch.zeros(8, 16, dtype=F64))


def test_kl_gradients_flow_through_logprobs() -> None:
    e = math.e
    # d k1 / d logp = 1;  d k2 / d logp = d;  d k3 / d logp = 1 - exp(-d) = 1 - pi_ref / pi:
    #   d = 1 -> 1 - e^-1 = 0.6321206; d = -1 -> 1 - e = -1.7182818; d = 0 -> 0
    expected = {"k1": [[1.0, 1.0, 1.0]], "k2": [[1.0, -1.0, 0.0]], "k3": [[1 - 1 / e, 1 - e, 0.0]]}
    for name, grad in expected.items():
        logprobs_BT = t(LOGPROBS).requires_grad_()
        KL_ESTIMATORS[name](logprobs_BT, t(REF_LOGPROBS)).sum().backward()
        assert logprobs_BT.grad is not None
        close(logprobs_BT.grad, grad)


def test_the_ratio_weighted_k3_has_the_reverse_kls_gradient() -> None:
    """DeepSeek-V3.2's Eq. 7 on-policy (π_old = π_θ in value): k3's value, and the gradient
    d(ratio · k3)/d logp = k3 + 1 − e^−d = d = log π − log π_ref, the reverse KL's score-function
    gradient, where k3's own is 1 − π_ref/π (test above): d = 1 → 1, d = −1 → −1, d = 0 → 0."""
    logprobs_BT = t(LOGPROBS).requires_grad_()
    kl_BT = KL_ESTIMATORS["k3_ratio"](logprobs_BT, t(REF_LOGPROBS), old_logprobs_BT=logprobs_BT.detach())
    close(kl_BT.detach(), [[1 / math.e, math.e - 2.0, 0.0]])
    kl_BT.sum().backward()
    assert logprobs_BT.grad is not None
    close(logprobs_BT.grad, [[1.0, -1.0, 0.0]])


# --- PPO clip loss -----------------------------------------------------------------------


def ppo_on_ratios(
    ratios: list[float], advantages: list[float], mask: list[bool] | None = None, **kwargs: float
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One sequence with old_logprobs = 0, so ratio = exp(logprobs); returns loss, grad, metrics.
    The clip range is PPO's symmetric 0.2 unless a test says otherwise."""
    kwargs.setdefault("clip_high", 0.2)
    logprobs_BT = torch.log(t([ratios])).requires_grad_()
    mask_BT = torch.tensor([mask if mask is not None else [True] * len(ratios)])
    loss_BT, metrics = ppo_clip_loss(
        LossInputs(logprobs_BT, torch.zeros_like(logprobs_BT), t([advantages]), mask_BT), **kwargs
    )
    loss_BT.sum().backward()
    assert logprobs_BT.grad is not None
    return loss_BT.detach(), logprobs_BT.grad, metrics


def test_ppo_ratio_inside_range_is_plain_policy_gradient() -> None:
    # ratio 1.1 in [0.8, 1.2]: loss = -r A = -2.2, d loss / d logp = -r A = -2.2
    # ratio 0.9, A = -1: loss = 0.9, grad = 0.9
    loss, grad, metrics = ppo_on_ratios([1.1, 0.9], [2.0, -1.0])
    close(loss, [[-2.2, 0.9]])
    close(grad, [[-2.2, 0.9]])
    close(metrics["clip_fraction"], 0.0)


def test_ppo_clipped_high_positive_advantage_has_zero_gradient() -> None:
    # ratio 1.5, A = 2: min(1.5 * 2, 1.2 * 2) = 2.4 -> loss -2.4, gradient 0
    loss, grad, metrics = ppo_on_ratios([1.5], [2.0])
    close(loss, [[-2.4]])
    close(grad, [[0.0]])
    close(metrics["clip_fraction_high"], 1.0)
    close(metrics["clip_fraction"], 1.0)


def test_ppo_clipped_low_negative_advantage_has_zero_gradient() -> None:
    # ratio 0.5, A = -1: min(-0.5, 0.8 * -1) = -0.8 -> loss 0.8, gradient 0
    loss, grad, metrics = ppo_on_ratios([0.5], [-1.0])
    close(loss, [[0.8]])
    close(grad, [[0.0]])
    close(metrics["clip_fraction_low"], 1.0)
    close(metrics["clip_fraction_high"], 0.0)


def test_ppo_negative_advantage_large_ratio_is_not_clipped() -> None:
    # ratio 1.5, A = -1: min(-1.5, -1.2) = -1.5 -> loss 1.5, gradient -r A = 1.5 (pessimistic bound)
    loss, grad, metrics = ppo_on_ratios([1.5], [-1.0])
    close(loss, [[1.5]])
    close(grad, [[1.5]])
    close(metrics["clip_fraction"], 0.0)


def test_ppo_clip_higher_is_asymmetric() -> None:
    # clip_low .2, clip_high .28 -> range [0.8, 1.28]
    # ratio 1.25, A = 1: inside -> loss -1.25, grad -1.25 (symmetric .2 would clip to -1.2, grad 0)
    # ratio 0.75, A = -1: below 0.8 -> loss 0.8, grad 0 (lower bound unchanged)
    loss, grad, _ = ppo_on_ratios([1.25, 0.75], [1.0, -1.0], clip_low=0.2, clip_high=0.28)
    close(loss, [[-1.25, 0.8]])
    close(grad, [[-1.25, 0.0]])
    loss, grad, _ = ppo_on_ratios([1.25, 0.75], [1.0, -1.0])
    close(loss, [[-1.2, 0.8]])
    close(grad, [[0.0, 0.0]])


def test_ppo_dual_clip_caps_negative_advantage() -> None:
    # ratio 5, A = -1: PPO loss = -min(-5, -1.2) = 5; dual clip 3: min(5, -3 * -1) = 3, grad 0
    # ratio 2, A = -1: loss 2 < 3, not capped, grad -r A = 2
    # ratio 5, A = +1: dual clip only for A < 0: -min(5, 1.2) = -1.2, grad 0 (ordinary clip)
    loss, grad, metrics = ppo_on_ratios([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], dual_clip=3.0)
    close(loss, [[3.0, 2.0, -1.2]])
    close(grad, [[0.0, 2.0, 0.0]])
    close(metrics["dual_clip_fraction"], 1 / 3)
    loss, grad, metrics = ppo_on_ratios([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0])
    close(loss, [[5.0, 2.0, -1.2]])
    close(grad, [[5.0, 2.0, 0.0]])
    close(metrics["dual_clip_fraction"], 0.0)


def hand_batch(
    nan_in_masked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # row 0: ratio 1.5 A +1 (high clip) | 0.5 A -1 (low clip) | 1.0 A +1 (none)
    # row 1: ratio 5.0 A -1 (dual clip) | 1.1 A +1 (none)     | masked: ratio 10 A +1
    logprobs_BT = torch.log(t([[1.5, 0.5, 1.0], [5.0, 1.1, 10.0]]))
    old_logprobs_BT = torch.zeros(2, 3, dtype=F64)
    advantages_BT = t([[1.0, -1.0, 1.0], [-1.0, 1.0, 1.0]])
    if nan_in_masked:
        logprobs_BT[1, 2] = math.nan
        old_logprobs_BT[1, 2] = -math.inf
        advantages_BT[1, 2] = math.inf
    mask_BT = torch.tensor([[True, True, True], [True, True, False]])
    return logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT


def test_ppo_metrics_on_hand_batch() -> None:
    loss_BT, metrics = ppo_clip_loss(LossInputs(*hand_batch()), clip_high=0.2, dual_clip=3.0)
    # losses: -1.2 | 0.8 | -1.0 ; min(5, 3) = 3 | -1.1 | 0 (masked)
    close(loss_BT, [[-1.2, 0.8, -1.0], [3.0, -1.1, 0.0]])
    # 5 unmasked tokens: one high clip, one low clip, one dual clip
    close(metrics["clip_fraction_high"], 1 / 5)
    close(metrics["clip_fraction_low"], 1 / 5)
    close(metrics["clip_fraction"], 2 / 5)
    close(metrics["dual_clip_fraction"], 1 / 5)
    # ratio mean (1.5 + 0.5 + 1.0 + 5.0 + 1.1) / 5 = 9.1 / 5 = 1.82; max 5 (masked 10 excluded)
    close(metrics["ratio_mean"], 1.82)
    close(metrics["ratio_max"], 5.0)
    for value in metrics.values():
        assert value.ndim == 0 and not value.requires_grad


def test_ppo_masked_positions_do_not_change_result_even_if_nan() -> None:
    results = []
    for nan_in_masked in (False, True):
        logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT = hand_batch(nan_in_masked)
        logprobs_BT.requires_grad_()
        loss_BT, metrics = ppo_clip_loss(
            LossInputs(logprobs_BT, old_logprobs_BT, advantages_BT, mask_BT), dual_clip=3.0
        )
        loss_BT.sum().backward()
        assert logprobs_BT.grad is not None
        results.append((loss_BT.detach(), logprobs_BT.grad, metrics))
    (loss_clean, grad_clean, metrics_clean), (loss_nan, grad_nan, metrics_nan) = results
    assert torch.isfinite(loss_nan).all() and torch.isfinite(grad_nan).all()
    assert torch.equal(loss_nan, loss_clean)
    assert torch.equal(grad_nan, grad_clean)
    assert grad_nan[1, 2] == 0.0 and loss_nan[1, 2] == 0.0
    for name, value in metrics_clean.items():
        assert torch.equal(metrics_nan[name], value), name


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"clip_low": -0.1}, "clip_low"),
        ({"clip_low": 1.1}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
    ],
)
def test_ppo_rejects_bad_arguments(kwargs: dict[str, float], name: str) -> None:
    x_BT = torch.zeros(1, 2)
    with pytest.raises(ValueError, match=name):
        ppo_clip_loss(LossInputs(x_BT, x_BT, x_BT, x_BT.bool()), **kwargs)


# --- aggregation -------------------------------------------------------------------------

# row 0 has 4 tokens, row 1 has 2 (masked positions hold junk 100), row 2 is empty
LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 100.0, 100.0], [7.0, 7.0, 7.0, 7.0]]
MASK = [[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]


def test_aggregate_token_mean() -> None:
    # (1 + 2 + 3 + 4 + 5 + 6) / 6 tokens = 21 / 6 = 3.5
    close(aggregate_loss(t(LOSS), t(MASK), mode="token-mean"), 3.5)
    # explicit total 10: 21 / 10
    close(aggregate_loss(t(LOSS), t(MASK), mode="token-mean", total_tokens=10), 2.1)


def test_aggregate_seq_mean_token_mean() -> None:
    # row means 10 / 4 = 2.5 and 11 / 2 = 5.5; the empty row counts 0: (2.5 + 5.5 + 0) / 3 = 8 / 3
    close(aggregate_loss(t(LOSS), t(MASK), mode="seq-mean-token-mean"), 8 / 3)
    # explicit total_seqs 2: (2.5 + 5.5) / 2 = 4
    close(aggregate_loss(t(LOSS), t(MASK), mode="seq-mean-token-mean", total_seqs=2), 4.0)


def test_aggregate_seq_mean_token_sum() -> None:
    # row sums 10 and 11, the empty row 0: 21 / 3 seqs = 7; with total_seqs 2: 21 / 2 = 10.5
    close(aggregate_loss(t(LOSS), t(MASK), mode="seq-mean-token-sum"), 7.0)
    close(aggregate_loss(t(LOSS), t(MASK), mode="seq-mean-token-sum", total_seqs=2), 10.5)


def test_aggregate_seq_mean_token_sum_norm() -> None:
    # 21 / (3 seqs * 4 max_tokens) = 1.75
    close(aggregate_loss(t(LOSS), t(MASK), mode="seq-mean-token-sum-norm", max_tokens=4), 1.75)
    # 21 / (2 * 8) = 1.3125
    close(
        aggregate_loss(
            t(LOSS), t(MASK), mode="seq-mean-token-sum-norm", total_seqs=2, max_tokens=8
        ),
        1.3125,
    )


def test_aggregate_empty_mask_gives_zero() -> None:
    for mode in AGGREGATIONS:
        close(aggregate_loss(t(LOSS), torch.zeros(3, 4), mode=mode, max_tokens=4), 0.0)


# 4 sequences of lengths 4, 1, 3, 2 (masked positions hold junk 9)
MICRO_LOSS = [[1.0, 2.0, 3.0, 4.0], [5.0, 9.0, 9.0, 9.0], [6.0, 7.0, 8.0, 9.0], [2.0, 4.0, 9, 9]]
MICRO_MASK = [[1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("mode", AGGREGATIONS)
def test_aggregate_micro_batches_sum_to_whole(mode: str) -> None:
    # micro-batches {0, 1} (5 tokens) and {2, 3} (5 tokens)
    loss_BT, mask_BT = t(MICRO_LOSS), t(MICRO_MASK)
    leaf_BT = loss_BT.clone().requires_grad_()

    def aggregate(rows: slice) -> torch.Tensor:  # totals of the whole batch: 10 tokens, 4 seqs
        return aggregate_loss(
            leaf_BT[rows], mask_BT[rows], mode=mode, total_tokens=10, total_seqs=4, max_tokens=4
        )

    whole = aggregate(slice(0, 4))
    (grad_whole,) = torch.autograd.grad(whole, leaf_BT)
    parts = aggregate(slice(0, 2)) + aggregate(slice(2, 4))
    (grad_parts,) = torch.autograd.grad(parts, leaf_BT)
    close(parts.detach(), whole.detach(), atol=1e-12)
    close(grad_parts, grad_whole, atol=1e-12)
    # hand values: token sum = 10 + 5 + 21 + 6 = 42
    #   token-mean 42 / 10 = 4.2; seq-mean-token-mean (2.5 + 5 + 7 + 3) / 4 = 4.375;
    #   seq-mean-token-sum 42 / 4 = 10.5; sum-norm 42 / (4 * 4) = 2.625
    expected = {"token-mean": 4.2, "seq-mean-token-mean": 4.375, "seq-mean-token-sum": 10.5,
                "seq-mean-token-sum-norm": 2.625}
    close(whole.detach(), expected[mode])


def test_aggregate_micro_batches_need_global_totals() -> None:
    # Without the totals, averaging per-micro-batch token-means weighs the micro-batches equally,
    # not the tokens: uneven split {0} (4 tokens) and {1, 2, 3} (6 tokens): (10/4 + 32/6) / 2
    loss_BT, mask_BT = t(MICRO_LOSS), t(MICRO_MASK)
    naive = (
        aggregate_loss(loss_BT[:1], mask_BT[:1], mode="token-mean")
        + aggregate_loss(loss_BT[1:], mask_BT[1:], mode="token-mean")
    ) / 2
    close(naive, (10 / 4 + 32 / 6) / 2)
    assert abs(naive.item() - 4.2) > 1e-3


def test_aggregate_seq_mean_token_mean_matches_loop() -> None:
    generator = torch.Generator().manual_seed(0)
    loss_BT = torch.randn(5, 7, generator=generator, dtype=F64)
    mask_BT = torch.rand(5, 7, generator=generator) < 0.6
    mask_BT[2] = False  # an empty sequence
    total = 0.0
    for b in range(5):
        tokens = [loss_BT[b, i].item() for i in range(7) if mask_BT[b, i]]
        total += sum(tokens) / len(tokens) if tokens else 0.0
    reference = total / 5
    close(aggregate_loss(loss_BT, mask_BT, mode="seq-mean-token-mean"), reference, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"mode": "seq-mean"}, "token-mean, seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm"),
        ({"mode": "seq-mean-token-sum-norm"}, "max_tokens"),
        ({"mode": "seq-mean-token-sum-norm", "max_tokens": 0}, "max_tokens"),
        ({"mode": "token-mean", "total_tokens": 0.0}, "total_tokens"),
        ({"mode": "seq-mean-token-mean", "total_seqs": -1.0}, "total_seqs"),
    ],
)
def test_aggregate_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        aggregate_loss(t(LOSS), t(MASK), **kwargs)  # type: ignore[arg-type]


def _positional(fn: object) -> tuple[str, ...]:
    import inspect

    return tuple(p.name for p in inspect.signature(fn).parameters.values()  # type: ignore[arg-type]
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


@pytest.mark.dtype_independent
def test_every_entry_of_a_registry_takes_the_same_positional_arguments() -> None:
    """One signature per dict: the loop calls any entry the same way; what an entry needs beyond
    these arrives by keyword (a config knob) or in its one record: `LossInputs` for a policy loss
    or an off-policy correction, `AdvantageInputs` for an advantage estimator. A KL estimator's
    third argument, π_old, is read by the ratio-weighted k3 alone. GAE is not an entry: it needs
    a critic, and PPO's module composes it (rlvr.train.methods.ppo)."""
    from collections.abc import Callable, Mapping
    from typing import Any

    from rlvr.algos import CORRECTIONS, DIVERGENCES, ESTIMATORS, KL_ESTIMATORS, LOSSES, SHAPING
    from rlvr.algos.advantages import AdvantageInputs

    expected: dict[str, tuple[Mapping[str, Callable[..., Any]], tuple[str, ...]]] = {
        "CORRECTIONS": (CORRECTIONS, ("x",)),
        "DIVERGENCES": (DIVERGENCES, ("logprobs_BT", "init_logprobs_BT", "mask_BT")),
        "ESTIMATORS": (ESTIMATORS, ("rewards_PG", "inputs")),
        "KL_ESTIMATORS": (KL_ESTIMATORS, ("logprobs_BT", "ref_logprobs_BT", "old_logprobs_BT")),
        "LOSSES": (LOSSES, ("x",)),
        "SHAPING": (SHAPING, ("rewards_PG", "lengths_PG", "correct_PG", "max_tokens")),
    }
    for name, (registry, positional) in expected.items():
        odd = {key: _positional(fn) for key, fn in registry.items() if _positional(fn) != positional}
        assert not odd, f"{name}: entries whose positional arguments differ from {positional}: {odd}"
    assert "gae" not in ESTIMATORS
    import inspect

    for key, fn in ESTIMATORS.items():  # the record's type is part of the signature
        assert inspect.signature(fn).parameters["inputs"].annotation in (AdvantageInputs, "AdvantageInputs"), key
    for key, fn in [*LOSSES.items(), *CORRECTIONS.items()]:
        assert inspect.signature(fn).parameters["x"].annotation in (LossInputs, "LossInputs"), key


# --- SAPO and GMPO (rlvr.algos.smooth_losses) ---------------------------------------------


def test_sapo_gate_by_hand() -> None:
    from rlvr.algos.smooth_losses import sapo_loss

    # on-policy (r = 1): f = σ(0)·4/τ = 2/τ, and f'(1) = 4σ(1 − σ) = 1: the policy-gradient gradient
    new = torch.tensor([[0.0, 0.5, 0.0]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, 0.0, 0.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    loss_BT, metrics = sapo_loss(LossInputs(new, old, adv, torch.ones(1, 3, dtype=torch.bool)), tau_pos=1.0, tau_neg=1.05)
    r = math.exp(0.5)
    sigma = 1 / (1 + math.exp(-(r - 1)))  # τ = 1 for A = 2 > 0
    close(loss_BT.detach(), torch.tensor([[-2.0, -2.0 * 4 * sigma, 2 / 1.05]], dtype=torch.float64), atol=1e-12)
    (grad,) = torch.autograd.grad(loss_BT.sum(), new)
    # d/dℓ of −A f(e^ℓ) = −A · 4σ(1 − σ) · r
    close(grad, torch.tensor([[-1.0, -2.0 * 4 * sigma * (1 - sigma) * r, 1.0]], dtype=torch.float64), atol=1e-12)
    close(metrics["gate_mean"], (1 + 4 * sigma * (1 - sigma) + 1) / 3, atol=1e-12)


def test_gmpo_geometric_mean_with_log_space_clip_by_hand() -> None:
    from rlvr.algos.smooth_losses import gmpo_loss

    new = torch.tensor([[0.1, 0.6, 9.0], [0.1, 0.6, 9.0]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(2, 3, dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]], dtype=torch.bool)  # the third token is masked junk
    loss_BT, metrics = gmpo_loss(LossInputs(new, old, adv, mask), clip_low=0.4, clip_high=0.4)
    # A > 0: min(0.1, 0.4), min(0.6, 0.4) → mean 0.25; A < 0: max(ℓ, −0.4) keeps both → mean 0.35
    s0, s1 = math.exp(0.25), math.exp(0.35)
    close(loss_BT.detach(), torch.tensor([[-s0, -s0, 0.0], [s1, s1, 0.0]], dtype=torch.float64), atol=1e-12)
    (grad,) = torch.autograd.grad(loss_BT[:, 0].sum(), new)  # one token's copy of each row's loss
    # row 0: the clipped token gets no gradient; d(−s)/dℓ_1 = −s/2. Row 1: d(s)/dℓ_t = s/2 each
    close(grad, torch.tensor([[-s0 / 2, 0.0, 0.0], [s1 / 2, s1 / 2, 0.0]], dtype=torch.float64), atol=1e-12)
    close(metrics["clip_fraction"], 0.25, atol=1e-12)  # 1 of 4 trained tokens clipped


@pytest.mark.parametrize("name", ["sapo", "gmpo"])
def test_smooth_losses_are_zero_for_equal_rewards_and_ignore_masked_junk(name: str) -> None:
    from rlvr.algos.losses import LOSSES

    new = torch.tensor([[0.3, float("nan")], [-0.2, 0.1]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[0.0, float("inf")], [0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0], [1, 1]], dtype=torch.bool)
    loss_BT, _ = LOSSES[name](LossInputs(new, old, torch.zeros(2, 2, dtype=torch.float64), mask))  # A = 0: equal rewards
    (grad,) = torch.autograd.grad(loss_BT.sum(), new)
    assert torch.equal(loss_BT.detach(), torch.zeros(2, 2, dtype=torch.float64)) and torch.equal(grad, torch.zeros_like(grad))
    loss_BT, _ = LOSSES[name](LossInputs(new, old, torch.ones(2, 2, dtype=torch.float64), mask))
    (grad,) = torch.autograd.grad(loss_BT.sum(), new)
    assert torch.isfinite(loss_BT).all() and loss_BT[0, 1] == 0 and grad[0, 1] == 0


def test_sapo_and_gmpo_aggregate_per_sequence_unless_told_otherwise() -> None:
    """Their papers (and verl) average a per-sequence objective over sequences; a token mean would
    weight GMPO's rows, whose every token repeats the row's loss, by their length."""
    from rlvr.config import load_config
    from rlvr.train.settings import settings_from_config

    def aggregation(*extra: str) -> str:
        return settings_from_config(load_config(None, list(extra)), []).loss.aggregation

    assert aggregation() == "token-mean"
    assert aggregation('algo.loss="gmpo"') == aggregation('algo.loss="sapo"') == aggregation('algo.loss="gspo"') \
        == "seq-mean-token-mean"
    assert aggregation('algo.loss="gmpo"', 'algo.aggregation="token-mean"') == "token-mean"
    assert aggregation('algo.aggregation="seq-mean-token-sum"') == "seq-mean-token-sum"


ROW_WISE = [['algo.loss="gmpo"'], ['algo.loss="gspo"'], ['algo.offpolicy="opsm"', "algo.offpolicy_kwargs={delta = 0.5}"]]
PER_TOKEN = [['algo.advantage="gae"'], ['algo.credit="turn"'],
             ['algo.advantage="process"', 'algo.advantage_kwargs={prm = "arithmetic_steps"}']]


@pytest.mark.parametrize("row_wise", ROW_WISE)
@pytest.mark.parametrize("per_token", PER_TOKEN)
def test_row_advantage_losses_refuse_per_token_credit(row_wise: list[str], per_token: list[str]) -> None:
    """GMPO, GSPO and OPSM read one advantage per row: per-token credit would be lost."""
    from rlvr.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="takes one advantage per row"):
        load_config(None, [*row_wise, *per_token])
    load_config(None, row_wise)  # each is fine alone
