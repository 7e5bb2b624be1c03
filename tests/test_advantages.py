"""Advantage estimators against hand-computed values, plus the properties each one promises."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import ESTIMATORS
from rlvr.config import ConfigError, load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

# Two groups of four: a mixed one and a constant one (no signal).
R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_rloo_by_hand() -> None:
    # r = 1: the other three average 1/3 -> 2/3; r = 0: they average 2/3 -> -2/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ESTIMATORS["rloo"](R), expected)
    assert (ESTIMATORS["rloo"](torch.tensor([[3.0], [5.0]])) == 0).all()  # G = 1: no other sample


def test_remax_subtracts_the_greedy_reward() -> None:
    baseline = torch.tensor([1.0, 0.5])
    expected = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    torch.testing.assert_close(ESTIMATORS["remax"](R, baseline_P=baseline), expected)
    with pytest.raises(ValueError, match="baseline_P"):
        ESTIMATORS["remax"](R, baseline_P=torch.tensor([1.0]))


def test_remax_baseline_is_not_a_config_setting() -> None:
    with pytest.raises(ConfigError, match="it takes no keywords"):
        load_config(None, ['algo.advantage="remax"', "algo.advantage_kwargs={baseline_P = 1.0}"])


def test_dr_grpo_is_mean_only() -> None:
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ESTIMATORS["dr_grpo"](R), expected)


def test_lite_ppo_by_hand() -> None:
    # batch std of the 8 rewards: mean 0.75, unbiased variance (6·0.0625 + 2·0.5625)/7 = 1.5/7
    std = math.sqrt(1.5 / 7)
    expected = torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0, 0.0, 0.0, 0.0]]) / (std + 1e-6)
    torch.testing.assert_close(ESTIMATORS["lite_ppo"](R), expected)


def test_reinforce_pp_by_hand() -> None:
    # with the group baseline: x = [.5, -.5, -.5, .5, 0, 0, 0, 0], mean 0, unbiased std sqrt(1/7)
    a = 0.5 / (math.sqrt(1 / 7) + 1e-6)
    torch.testing.assert_close(ESTIMATORS["reinforce_pp"](R), torch.tensor([[a, -a, -a, a], [0.0] * 4]))
    # without: the raw rewards whitened over the batch (mean 0.75, std sqrt(1.5/7))
    std = math.sqrt(1.5 / 7) + 1e-6
    hi, lo = 0.25 / std, -0.75 / std
    torch.testing.assert_close(ESTIMATORS["reinforce_pp"](R, group_baseline=False),
                               torch.tensor([[hi, lo, lo, hi], [hi] * 4]))


def test_bnpo_by_hand() -> None:
    # group means p = 0.25, 0.5, 0.75: m = 0.5, unbiased v = 0.0625, m(1-m)/v - 1 = 3,
    # a = b = 1.5, α = β = 1 + 1.5/3 = 1.5; Beta(1.5, 1.5) pdf = sqrt(p(1-p)) / (π/8)
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    w_quarter = (math.pi / 8) / math.sqrt(0.25 * 0.75)  # 0.906900
    w_half = (math.pi / 8) / 0.5  # π/4
    expected = torch.tensor([
        [0.75 * w_quarter, -0.25 * w_quarter, -0.25 * w_quarter, -0.25 * w_quarter],
        [0.5 * w_half, 0.5 * w_half, -0.5 * w_half, -0.5 * w_half],
        [0.25 * w_quarter, 0.25 * w_quarter, 0.25 * w_quarter, -0.75 * w_quarter],
    ])
    torch.testing.assert_close(ESTIMATORS["bnpo"](rewards), expected, atol=1e-6, rtol=1e-6)


def test_bnpo_with_one_prompt_is_reinforce_with_group_mean() -> None:
    # nothing to fit: α = β = 1, the uniform density, weight 1
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ESTIMATORS["bnpo"](rewards), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))


def test_bnpo_rejects_rewards_outside_its_range() -> None:
    with pytest.raises(ValueError, match="inside"):
        ESTIMATORS["bnpo"](torch.tensor([[2.0, 0.0]]))
    torch.testing.assert_close(  # an affine map brings them in
        ESTIMATORS["bnpo"](torch.tensor([[2.0, 0.0]]), max_reward=2.0), torch.tensor([[0.5, -0.5]])
    )


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "bnpo"])  # remax: by design not
def test_equal_rewards_give_zero_advantage(name: str) -> None:
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    out = ESTIMATORS[name](rewards)
    assert out.shape == rewards.shape
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert (out[1] != 0).all()


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "bnpo"])
def test_vectorised_equals_a_plain_loop(name: str) -> None:
    """Per-group estimators applied to each group alone give the same as the batch, where the
    estimator only looks at its own group; batch-level ones are checked against a loop over the
    formula instead."""
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0], [0.0, 0.0, 1.0, 1.0], [0.2, 0.9, 0.4, 0.4]])
    out = ESTIMATORS[name](rewards)
    flat = rewards.flatten().tolist()
    mean_b = sum(flat) / len(flat)
    std_b = math.sqrt(sum((x - mean_b) ** 2 for x in flat) / (len(flat) - 1))
    for p, row in enumerate(rewards.tolist()):
        g = len(row)
        mean_g = sum(row) / g
        std_g = math.sqrt(sum((x - mean_g) ** 2 for x in row) / (g - 1))
        for k, r in enumerate(row):
            expected = {
                "grpo": (r - mean_g) / (std_g + 1e-6),
                "dr_grpo": r - mean_g,
                "rloo": r - (sum(row) - r) / (g - 1),
                "lite_ppo": (r - mean_g) / (std_b + 1e-6),
            }.get(name)
            if expected is not None:
                assert float(out[p, k]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if name == "reinforce_pp":
        centered = [r - sum(row) / len(row) for row in rewards.tolist() for r in row]
        mean_c = sum(centered) / len(centered)
        std_c = math.sqrt(sum((x - mean_c) ** 2 for x in centered) / (len(centered) - 1))
        expected_all = [(x - mean_c) / (std_c + 1e-6) for x in centered]
        assert out.flatten().tolist() == pytest.approx(expected_all, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_two_training_steps_with_every_estimator(name: str, tiny_dir: Path, tmp_path: Path) -> None:
    """Every registered estimator drives real updates end to end (ppo_clip loss)."""
    summary = train(load_config(None, overrides(tiny_dir, tmp_path, f"adv-{name}", algo__advantage=f'"{name}"')),
                    quiet=True)
    rows = read_metrics(tmp_path / f"adv-{name}")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["advantage_abs_mean"] > 0 and r["trained_fraction"] > 0 for r in rows)
    assert summary["steps"] == 2
    if name == "remax":  # the loop sampled and scored one greedy completion per prompt
        assert all(0 < r["greedy_reward"] <= 1 for r in rows)


def test_estimator_keywords_are_checked_against_the_function() -> None:
    with pytest.raises(ConfigError, match="did you mean 'normalize_std'"):
        load_config(None, ["algo.advantage_kwargs={normalise_std = false}"])
    with pytest.raises(ConfigError, match="'rloo'.*it takes no keywords"):
        load_config(None, ['algo.advantage="rloo"', "algo.advantage_kwargs={normalize_std = false}"])
    cfg = load_config(None, ['algo.advantage="bnpo"', "algo.advantage_kwargs={max_reward = 2.0}"])
    assert cfg.algo.advantage_kwargs == {"max_reward": 2.0}


def test_loss_gets_the_clip_settings_it_takes() -> None:
    assert load_config(None, []).algo.policy_loss_kwargs() == {}  # the loss's own defaults
    cfg = load_config(None, ["algo.clip_high=0.3", "algo.dual_clip=3.0"])
    assert cfg.algo.policy_loss_kwargs() == {"clip_high": 0.3, "dual_clip": 3.0}
    cfg = load_config(None, ['algo.loss="gspo"', "algo.clip_high=5e-4", "algo.dual_clip=3.0"])
    assert cfg.algo.policy_loss_kwargs() == {"clip_high": 5e-4}  # gspo takes no dual_clip
    with pytest.raises(ConfigError, match="did you mean 'clip_high'"):
        load_config(None, ["algo.loss_kwargs={clip_hgh = 0.3}"])
