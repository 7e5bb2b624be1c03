"""The sequence masks against engine/learner mismatch (rlvr.algos.offpolicy): the geometric-mean
mask and DeepSeek-V3.2's off-policy sequence masking, on hand-computed values and against TRL's
own implementation of OPSM."""

from __future__ import annotations

import math

import pytest
import torch

from rlvr.algos import CORRECTIONS
from rlvr.algos.inputs import LossInputs
from rlvr.algos.offpolicy import geometric_mask, offpolicy_sequence_mask

F64 = torch.float64


def t(values: object) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def record(old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor | None = None,
           logprobs: torch.Tensor | None = None) -> LossInputs:
    """What a correction reads: π_old, μ and the mask; OPSM also the advantages and π_θ's log-probs
    (the geometric mask reads neither: they default to zeros and π_old)."""
    return LossInputs(logprobs=old if logprobs is None else logprobs, old=old,
                      advantages=torch.zeros_like(old) if advantages is None else advantages, mask=mask,
                      sampler=sampler)


def test_geometric_mask_keeps_rows_whose_mean_log_ratio_is_inside_the_bounds() -> None:
    sampler = t([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    # per-token log(π_old / μ); the bounds are log 0.999 = -0.0010005 and log 1.001 = 0.0009995
    old = sampler + t([[0.0005, 0.0005],     # mean 0.0005: kept
                       [0.003, -0.0005],     # mean 0.00125: dropped, though one token is inside
                       [-0.0009, 50.0],      # mean over its one trained token: -0.0009, kept
                       [0.0019, 0.0]])       # mean 0.00095 with the product 1.0019 outside: kept
    mask = t([[1, 1], [1, 1], [1, 0], [1, 1]])
    weights, metrics = geometric_mask(record(old, sampler, mask))
    torch.testing.assert_close(weights, t([[1, 1], [0, 0], [1, 0], [1, 1]]), atol=0, rtol=0)
    assert float(metrics["is_masked_fraction"]) == pytest.approx(2 / 7)
    assert CORRECTIONS["geo_mask"] is geometric_mask


def test_geometric_mask_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="low"):
        geometric_mask(record(t([[0.0]]), t([[0.0]]), t([[1]])), low=1.1)


def test_opsm_drops_negative_rows_that_drifted_past_delta() -> None:
    sampler = t([[-1.0, -1.0]] * 4)
    # drift per row = mean over tokens of log μ − log π_θ
    logprobs = sampler - t([[0.3, 0.3],    # drift 0.3 with A < 0: dropped
                            [0.3, 0.3],    # drift 0.3 with A > 0: kept
                            [0.1, 0.1],    # drift 0.1 <= δ with A < 0: kept
                            [0.3, 9.0]])   # drift 0.3 (the padded 9 does not count), A < 0: dropped
    advantages = t([[-1.0, -1.0], [1.0, 1.0], [-1.0, -1.0], [-0.5, -0.5]])
    mask = t([[1, 1], [1, 1], [1, 1], [1, 0]])
    weights, metrics = offpolicy_sequence_mask(record(sampler, sampler, mask, advantages, logprobs), delta=0.2)
    torch.testing.assert_close(weights, t([[0, 0], [1, 1], [1, 1], [0, 0]]), atol=0, rtol=0)
    assert float(metrics["opsm_masked_fraction"]) == 0.5
    # the sign is the row's mean advantage: mixed per-token advantages decide as a whole
    weights, _ = offpolicy_sequence_mask(record(sampler[:1], sampler[:1], mask[:1], t([[-2.0, 1.0]]), logprobs[:1]),
                                         delta=0.2)
    assert weights.tolist() == [[0.0, 0.0]]


def test_opsm_needs_its_delta_from_the_config() -> None:
    from rlvr.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="missing keyword 'delta'"):
        load_config(None, ["algo.offpolicy=opsm"])
    cfg = load_config(None, ["algo.offpolicy=opsm", "algo.offpolicy_kwargs={delta = 0.5}"])
    assert cfg.algo.offpolicy_kwargs == {"delta": 0.5}


def test_opsm_agrees_with_trl() -> None:
    """TRL 1.x's GRPOTrainer.get_off_policy_mask as the oracle, over random batches: the same rows
    kept (its advantages are one per row, as outcome advantages are)."""
    trl = pytest.importorskip("trl.trainer.grpo_trainer")
    generator = torch.Generator().manual_seed(0)
    for _ in range(100):
        b, n = 6, 9
        mask = (torch.arange(n)[None, :] < torch.randint(1, n + 1, (b, 1), generator=generator)).to(F64)
        sampler = -torch.rand(b, n, generator=generator, dtype=F64) * 3
        logprobs = sampler + torch.randn(b, n, generator=generator, dtype=F64) * 0.3
        advantages = torch.randn(b, 1, generator=generator, dtype=F64)
        delta = float(torch.rand((), generator=generator)) * 0.2
        theirs = trl.GRPOTrainer.get_off_policy_mask(advantages, logprobs, sampler, mask, delta)  # (B, 1)
        ours, _ = offpolicy_sequence_mask(record(sampler, sampler, mask, advantages.expand(b, n), logprobs),
                                          delta=delta)
        assert torch.equal(ours, theirs.expand(b, n) * mask), (ours, theirs)


def test_masks_carry_no_gradient_and_zero_masked_positions() -> None:
    old = t([[-1.0, math.nan]])
    for name, x, kwargs in [("geo_mask", record(old, old, t([[1, 0]])), {}),
                            ("opsm", record(old, old, t([[1, 0]]), t([[-1.0, 0.0]]), t([[-1.0, math.nan]])),
                             {"delta": 0.0})]:
        weights, _ = CORRECTIONS[name](x, **kwargs)
        assert weights.tolist() == [[1.0, 0.0]] and not weights.requires_grad
