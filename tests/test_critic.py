"""PPO with a learned critic (GAE, the clipped value loss) and the KL penalty in the reward."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos.advantages import gae_advantages as gae
from rlvr.algos.kl import KLController
from rlvr.config import ConfigError, load_config
from rlvr.train.checkpoint import load_state
from rlvr.train.critic import Critic, value_loss
from rlvr.train.loop import train
from tests.test_train import TIMING, overrides, read_metrics
from tests.tiny import make_tiny_model


def test_gae_by_hand() -> None:
    # rewards [0, 0, 1], V = 0.5 everywhere, γ = 1, λ = 0.5:
    # δ3 = 1 - 0.5 = 0.5 -> A3 = 0.5; δ2 = 0 + 0.5 - 0.5 = 0 -> A2 = 0.25; δ1 = 0 -> A1 = 0.125
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.full((1, 3), 0.5)
    adv, ret = gae(rewards, torch.ones(1, 3, dtype=torch.bool), values_BT=values, lam=0.5, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.125, 0.25, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.625, 0.75, 1.0]]))
    # γ = 0.9, λ = 1: A_t = Σ γ^k r_{t+k} - V_t (Monte Carlo return minus the value)
    adv, ret = gae(rewards, torch.ones(1, 3, dtype=torch.bool), values_BT=values, gamma=0.9, lam=1.0, whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[0.81 - 0.5, 0.9 - 0.5, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.81, 0.9, 1.0]]))


def test_gae_skips_masked_positions_and_whitens_over_the_batch() -> None:
    mask = torch.tensor([[True, False, True, True], [True, True, False, False]])
    rewards = torch.tensor([[0.0, 99.0, 0.0, 1.0], [0.0, -1.0, 7.0, 7.0]])
    values = torch.tensor([[0.2, 99.0, 0.4, 0.6], [0.1, 0.3, 5.0, 5.0]])
    adv, ret = gae(rewards, mask, values_BT=values, lam=0.9, whiten=False)
    plain, plain_ret = gae(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool),
                           values_BT=torch.tensor([[0.2, 0.4, 0.6]]), lam=0.9, whiten=False)
    torch.testing.assert_close(adv[0, [0, 2, 3]], plain[0])  # as if the masked token were not there
    torch.testing.assert_close(ret[0, [0, 2, 3]], plain_ret[0])
    assert adv[~mask].eq(0).all() and ret[~mask].eq(0).all()
    white, _ = gae(rewards, mask, values_BT=values, lam=0.9)
    picked = white[mask]
    assert abs(float(picked.mean())) < 1e-6 and float(picked.std()) == pytest.approx(1.0, abs=1e-5)
    assert white[~mask].eq(0).all()


def test_value_loss_by_hand() -> None:
    old, ret, mask = torch.tensor([[0.5, 0.5]]), torch.tensor([[1.2, 0.6]]), torch.ones(1, 2, dtype=torch.bool)
    values = torch.tensor([[1.0, 0.55]], requires_grad=True)
    loss, m = value_loss(values, old, ret, mask, clip=0.2)
    # token 1: (1.0 - 1.2)² = 0.04 vs clipped V = 0.7: (0.7 - 1.2)² = 0.25 -> ½·0.25
    # token 2: inside the clip, (0.55 - 0.6)² = 0.0025 -> ½·0.0025
    torch.testing.assert_close(loss, torch.tensor([[0.125, 0.00125]]))
    assert float(m["value_clip_fraction"]) == 0.5
    loss.sum().backward()
    assert values.grad is not None
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.05]]))  # the clipped term has no gradient
    plain, _ = value_loss(values, old, ret, mask, clip=None)
    torch.testing.assert_close(plain, torch.tensor([[0.02, 0.00125]]))


def test_critic_values_align_with_the_state_before_each_token() -> None:
    critic = Critic(make_tiny_model())
    with torch.no_grad():
        critic.head.weight.fill_(0.01)
    ids = torch.tensor([[5, 6, 7, 8]])
    full = critic(ids, torch.ones_like(ids))
    prefix = critic(ids[:, :3], torch.ones(1, 3, dtype=torch.long))
    # V at position t depends only on tokens before t: the value of token 3 is unchanged by token 4
    torch.testing.assert_close(full[:, :3], prefix)
    assert full[0, 0] == 0 and full[0, 1] != 0


def test_adaptive_kl_controller_by_hand() -> None:
    ctl = KLController(0.1, target=1.0, horizon=100)
    ctl.update(2.0, n=10)  # error clipped to +0.2: β · (1 + 0.2·10/100)
    assert ctl.value == pytest.approx(0.102)
    ctl.update(0.5, n=10)  # error -0.5 clipped to -0.2
    assert ctl.value == pytest.approx(0.102 * 0.98)
    ctl.update(1.1, n=100)  # error 0.1, unclipped
    assert ctl.value == pytest.approx(0.102 * 0.98 * 1.1)
    fixed = KLController(0.1)
    fixed.update(5.0, n=10)
    assert fixed.value == 0.1
    with pytest.raises(ConfigError, match="kl_placement"):
        load_config(None, ["algo.kl_coef=0.1", "algo.kl_adaptive.target=1.0"])
    with pytest.raises(ConfigError, match="missing keyword 'target'"):
        load_config(None, ["algo.kl_coef=0.1", 'algo.kl_placement="reward"', "algo.kl_adaptive.horizon=10"])
    with pytest.raises(ConfigError, match="is now algo.kl_adaptive.target"):
        load_config(None, ["algo.kl_target=1.0"])


def test_ppo_with_gae_trains_the_critic_and_resumes_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    extra = {"algo__advantage": '"gae"', "algo__advantage_kwargs": "{critic_lr = 1e-3}", "algo__kl_coef": 0.05,
             "algo__kl_placement": '"reward"', "algo__kl_estimator": '"k1"',
             "algo__kl_adaptive": "{target = 0.01, horizon = 100}"}
    train(load_config(None, overrides(tiny_dir, tmp_path, "ppo", train__steps=3, **extra)), quiet=True)
    rows = read_metrics(tmp_path / "ppo")
    for r in rows:
        assert math.isfinite(r["value_loss"]) and r["critic_grad_norm"] > 0
        assert {"value_clip_fraction", "value_mean", "kl_reward", "kl_coef"} <= r.keys()
    assert rows[0]["kl_coef"] == 0.05 and rows[1]["kl_coef"] != 0.05  # adapted after step 1
    assert rows[1]["kl_reward"] != 0  # the policy moved away from the reference
    state = load_state(tmp_path / "ppo" / "checkpoints" / "step_000003")
    head = state["critic"]["model"]["head.weight"]
    assert head.abs().sum() > 0  # the critic learned (its head started at zero)
    assert state["kl"]["value"] == pytest.approx(rows[-1]["kl_coef"] * (1 + max(-0.2, min(0.2, rows[-1]["kl_reward"] / 0.01 - 1)) * 16 / 100))
    # 2 steps, then resumed to 3: step 3 is the same as in the straight run (critic, optimiser, β restored)
    train(load_config(None, overrides(tiny_dir, tmp_path, "ppo2", train__steps=2, **extra)), quiet=True)
    train(resume=tmp_path / "ppo2", overrides=("train.steps=3",), quiet=True)
    resumed = read_metrics(tmp_path / "ppo2")
    assert {k: v for k, v in resumed[2].items() if k not in TIMING} == {k: v for k, v in rows[2].items() if k not in TIMING}


def test_kl_in_the_reward_lowers_the_advantage_of_samples_that_moved(tiny_dir: Path, tmp_path: Path) -> None:
    """With the KL in the reward, GRPO's advantages differ from the same run without it."""
    train(load_config(None, overrides(tiny_dir, tmp_path, "plain", train__steps=2)), quiet=True)
    train(load_config(None, overrides(tiny_dir, tmp_path, "klr", train__steps=2, algo__kl_coef=5.0,
                                      algo__kl_placement='"reward"', algo__kl_estimator='"k1"')), quiet=True)
    plain, klr = read_metrics(tmp_path / "plain"), read_metrics(tmp_path / "klr")
    assert plain[0]["reward"] == klr[0]["reward"]  # same samples at step 1
    assert klr[0]["kl_reward"] == 0.0  # the policy is the reference at step 1
    assert "kl" not in klr[0]  # no KL term in the loss
    assert klr[1]["kl_reward"] != 0.0 and klr[1]["advantage_abs_mean"] != plain[1]["advantage_abs_mean"]


def test_gae_puts_each_turns_reward_on_that_turns_last_sampled_token() -> None:
    """An episode of two turns, rewards 0.25 and 1: sampled a a | injected o o | sampled b b.
    With V = 0, γ = λ = 1 (no whitening) a token's advantage is the reward still to come, so
    turn 0's tokens get 1.25 and turn 1's (and the observation's) only 1: the intermediate
    reward is not summed onto the episode's last token."""
    from rlvr.options import GaeOptions
    from rlvr.train.methods.ppo import reward_positions as _reward_positions
    from rlvr.train.methods.ppo import token_advantages as _token_advantages
    from rlvr.types import Completion, Sample

    episode = Completion((5, 6, 7, 8, 9, 10), (0.0,) * 6, "stop", "", loss_mask=(1, 1, 0, 0, 1, 1),
                         turn_index=(0, 0, 0, 0, 1, 1))
    assert _reward_positions(episode, 1.25, [0.25, 1.0]) == [(1, 0.25), (5, 1.0), (5, 0.0)]
    assert _reward_positions(episode, 1.0, [0.25, 1.0]) == [(1, 0.25), (5, 1.0), (5, -0.25)]  # shaped by -0.25
    assert _reward_positions(episode, 1.25, None) == [(5, 1.25)]  # single-turn: the outcome on the last token
    sample = Sample((1, 2), episode, 1.25, {"env": 1.25}, 0)
    options = GaeOptions(lam=1.0, whiten=False)
    advantages, _ = _token_advantages([sample], torch.tensor([[1.25]]), None, [torch.zeros(6)], {0}, 0.0,
                                      [[0.25, 1.0]], options)
    torch.testing.assert_close(advantages[0], torch.tensor([1.25, 1.25, 1.0, 1.0, 1.0, 1.0]))
