"""Advantage estimators against hand-computed values, plus the properties each one promises."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import ESTIMATORS
from rlvr.algos.advantages import AdvantageInputs, gae_advantages
from rlvr.config import ConfigError, load_config
from rlvr.train.loop import train
from rlvr.train.settings import AdvantageSettings, UpdateSettings
from rlvr.train.update import compute_advantages
from rlvr.types import Completion, Group, Sample
from tests.test_train import overrides, read_metrics

# Two groups of four: a mixed one and a constant one (no signal).
R = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])


def test_rloo_by_hand() -> None:
    # r = 1: the other three average 1/3 -> 2/3; r = 0: they average 2/3 -> -2/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(ESTIMATORS["rloo"](R), expected)
    assert (ESTIMATORS["rloo"](torch.tensor([[3.0], [5.0]])) == 0).all()  # G = 1: no other sample


def test_rft_keeps_what_the_reward_accepts() -> None:
    rft = ESTIMATORS["rft"]
    torch.testing.assert_close(rft(R), torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]]))
    scores = torch.tensor([[0.2, 0.9, 0.5, 0.9]])
    torch.testing.assert_close(rft(scores, threshold=0.5), torch.tensor([[0.0, 1.0, 1.0, 1.0]]))
    # RAFT: the best of each group only, ties to the first
    torch.testing.assert_close(rft(scores, threshold=None, top_k=1), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(rft(scores, threshold=0.6, top_k=3), torch.tensor([[0.0, 1.0, 0.0, 1.0]]))


def test_rft_with_pg_is_sft_on_the_accepted_samples(tiny_dir: Path, tmp_path: Path) -> None:
    """One step of rejection-sampling fine-tuning: the kept samples become likelier, the rest are not trained."""
    extra = ['algo.advantage="rft"', 'algo.loss="pg"', "algo.advantage_kwargs={threshold = 0.5}"]
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "rft", train__steps=1), *extra]), quiet=True)
    row = read_metrics(tmp_path / "rft")[0]
    assert 0 < row["trained_fraction"] < 1 and row["grad_norm"] > 0


def test_remax_subtracts_the_greedy_reward() -> None:
    baseline = torch.tensor([1.0, 0.5])
    expected = torch.tensor([[0.0, -1.0, -1.0, 0.0], [0.5, 0.5, 0.5, 0.5]])
    torch.testing.assert_close(ESTIMATORS["remax"](R, AdvantageInputs(greedy_P=baseline)), expected)
    with pytest.raises(ValueError, match="greedy_P"):
        ESTIMATORS["remax"](R, AdvantageInputs(greedy_P=torch.tensor([1.0])))
    with pytest.raises(ValueError, match="greedy_P"):
        ESTIMATORS["remax"](R)


def test_remax_baseline_is_not_a_config_setting() -> None:
    with pytest.raises(ConfigError, match="it takes no keywords"):
        load_config(None, ['algo.advantage="remax"', "algo.advantage_kwargs={baseline_P = 1.0}"])
    with pytest.raises(ConfigError, match="it takes no keywords"):
        load_config(None, ['algo.advantage="remax"', "algo.advantage_kwargs={greedy_P = 1.0}"])


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


def test_bnpo_decomposition_averages_one_fit_per_reward_part() -> None:
    correct = torch.tensor([[1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    fmt = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    inputs = AdvantageInputs(parts={"correct": correct, "format": fmt, "turns": torch.ones_like(fmt)},
                             components=("correct", "format"))
    out = ESTIMATORS["bnpo"](correct + fmt, inputs, decompose=True)
    expected = (ESTIMATORS["bnpo"](correct) + ESTIMATORS["bnpo"](fmt)) / 2
    torch.testing.assert_close(out, expected)
    assert (out[2, :3] == out[2, 0]).all() and out[2, 3] < 0  # the format part is constant there: no signal
    with pytest.raises(ValueError, match="no reward component"):
        ESTIMATORS["bnpo"](correct, decompose=True)


def test_stratified_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0, 1.0, 0.0, 1.0, 1.0]])
    strata = torch.tensor([[0, 0, 0, 1, 1, 1]])
    # stratum 0: [1, 0, 1], mean 2/3, unbiased std sqrt(1/3); stratum 1: [0, 1, 1], the same
    hi, lo = (1 / 3) / (math.sqrt(1 / 3) + 1e-6), (-2 / 3) / (math.sqrt(1 / 3) + 1e-6)
    san = torch.tensor([[hi, lo, hi, lo, hi, hi]])
    torch.testing.assert_close(ESTIMATORS["stratified"](rewards, AdvantageInputs(parts={"s": strata}), stratum="s", alpha=1.0), san)
    # blended half-half with GRPO: mean 2/3, unbiased std over six sqrt(4/15)
    g_hi, g_lo = (1 / 3) / (math.sqrt(4 / 15) + 1e-6), (-2 / 3) / (math.sqrt(4 / 15) + 1e-6)
    grpo = torch.tensor([[g_hi, g_lo, g_hi, g_lo, g_hi, g_hi]])
    torch.testing.assert_close(ESTIMATORS["stratified"](rewards, AdvantageInputs(parts={"s": strata}), stratum="s"), (san + grpo) / 2)
    torch.testing.assert_close(ESTIMATORS["stratified"](rewards, AdvantageInputs(parts={"s": strata}), stratum="s", alpha=0.0), ESTIMATORS["grpo"](rewards))


def test_stratified_removes_the_cross_stratum_offset() -> None:
    # stratum 1 scores higher across the board: within-stratum ranking is all that SAN sees
    rewards = torch.tensor([[0.0, 0.2, 0.8, 1.0]])
    strata = torch.tensor([[0, 0, 1, 1]])
    out = ESTIMATORS["stratified"](rewards, AdvantageInputs(parts={"s": strata}), stratum="s", alpha=1.0)
    torch.testing.assert_close(out[0, :2], out[0, 2:])
    # singletons and equal-reward strata carry no signal; ids only compare within a prompt
    out = ESTIMATORS["stratified"](torch.tensor([[1.0, 0.0, 0.0], [0.5, 0.5, 0.0]]),
                                   AdvantageInputs(parts={"s": torch.tensor([[0, 1, 1], [0, 0, 1]])}), stratum="s",
                                   alpha=1.0)
    assert (out == 0).all()


def pool(mean_P: torch.Tensor, std_P: torch.Tensor) -> AdvantageInputs:
    return AdvantageInputs(pool_mean_P=mean_P, pool_std_P=std_P)


def test_global_pool_by_hand() -> None:
    rewards = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    out = ESTIMATORS["global_pool"](rewards, pool(torch.tensor([0.25, 1.0]), torch.tensor([0.5, 0.0])))
    torch.testing.assert_close(out, torch.tensor([[0.75 / (0.5 + 1e-6), -0.25 / (0.5 + 1e-6)], [0.0, 0.0]]))
    # an equal-reward group still has signal against a pool that was not all equal
    out = ESTIMATORS["global_pool"](torch.tensor([[1.0, 1.0]]), pool(torch.tensor([0.5]), torch.tensor([0.5])),
                                    normalize_std=False)
    torch.testing.assert_close(out, torch.tensor([[0.5, 0.5]]))


def test_global_pool_reads_the_groups_pool_and_falls_back_to_the_group() -> None:
    def sample(r: float) -> Sample:
        return Sample((1,), Completion((2,), (-0.1,), "stop", "x"), r, {"chars": r}, 0)

    pooled = Group("p", (sample(1.0), sample(0.0)), pool_rewards=(1.0, 0.0, 0.0, 0.0))
    plain = Group("q", (sample(1.0), sample(0.0)))
    s = UpdateSettings(advantage=AdvantageSettings(name="global_pool"))
    out = compute_advantages([pooled, plain], s)
    std = math.sqrt(0.25) + 1e-6  # pool [1, 0, 0, 0]: mean 0.25, unbiased std 0.5
    torch.testing.assert_close(out[0], torch.tensor([0.75 / std, -0.25 / std]))
    torch.testing.assert_close(out[1], ESTIMATORS["grpo"](torch.tensor([[1.0, 0.0]]))[0])


def test_stratified_reads_the_strata_from_a_reward_part() -> None:
    def sample(r: float, calls: float) -> Sample:
        return Sample((1,), Completion((2,), (-0.1,), "stop", "x"), r, {"acc": r, "calls": calls}, 0)

    group = Group("p", (sample(1.0, 0), sample(0.0, 0), sample(1.0, 2), sample(0.5, 2)))
    out = compute_advantages([group], UpdateSettings(advantage=AdvantageSettings(
        name="stratified", kwargs={"stratum": "calls", "alpha": 1.0})))
    expected = ESTIMATORS["stratified"](torch.tensor([[1.0, 0.0, 1.0, 0.5]]),
                                        AdvantageInputs(parts={"s": torch.tensor([[0, 0, 2, 2]])}), stratum="s",
                                        alpha=1.0)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="'tools' is not a reward of this run"):
        compute_advantages([group], UpdateSettings(advantage=AdvantageSettings(name="stratified",
                                                                               kwargs={"stratum": "tools"})))
    with pytest.raises(ConfigError, match="'stratified': missing keyword 'stratum'"):
        load_config(None, ['algo.advantage="stratified"'])
    with pytest.raises(ConfigError, match="is now algo.advantage_kwargs.stratum"):
        load_config(None, ['algo.advantage="stratified"', 'algo.stratum_key="calls"'])


def test_loop_inputs_are_not_config_settings() -> None:
    with pytest.raises(ConfigError, match="unknown keyword 'parts'"):
        load_config(None, ['algo.advantage="stratified"', "algo.advantage_kwargs={stratum = \"x\", parts = 1}"])
    with pytest.raises(ConfigError, match="unknown keyword 'inputs'"):
        load_config(None, ['algo.advantage="bnpo"', "algo.advantage_kwargs={inputs = 1}"])


def inputs_for(rewards: torch.Tensor) -> AdvantageInputs:
    """What the loop would pass: two strata per group, and each group as its own pool."""
    return AdvantageInputs(parts={"s": torch.arange(rewards.shape[1]).remainder(2).expand_as(rewards)},
                           pool_mean_P=rewards.mean(1), pool_std_P=rewards.std(1))


def call(name: str, rewards: torch.Tensor, **kwargs: object) -> torch.Tensor:
    if name == "stratified":
        kwargs.setdefault("stratum", "s")
    return ESTIMATORS[name](rewards, inputs_for(rewards), **kwargs)


# remax: by design not (its baseline is the greedy answer's reward)
@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "bnpo", "stratified",
                                  "global_pool"])
def test_equal_rewards_give_zero_advantage(name: str) -> None:
    rewards = torch.tensor([[0.3, 0.3, 0.3], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    out = call(name, rewards)
    assert out.shape == rewards.shape
    assert (out[0] == 0).all() and (out[2] == 0).all()
    assert (out[1] != 0).all()


def test_stratified_and_global_pool_equal_a_plain_loop() -> None:
    rewards = torch.tensor([[1.0, 0.0, 0.5, 0.0, 1.0], [0.2, 0.9, 0.4, 0.4, 0.7]])
    strata = torch.tensor([[0, 0, 1, 1, 1], [2, 2, 2, 5, 5]])
    san = ESTIMATORS["stratified"](rewards, AdvantageInputs(parts={"s": strata}), stratum="s", alpha=1.0)
    pool_mean, pool_std = torch.tensor([0.3, 0.6]), torch.tensor([0.4, 0.2])
    pooled = ESTIMATORS["global_pool"](rewards, pool(pool_mean, pool_std))
    for p, row in enumerate(rewards.tolist()):
        for g, r in enumerate(row):
            peers = [x for x, k in zip(row, strata[p].tolist()) if k == strata[p, g]]
            mean = sum(peers) / len(peers)
            std = math.sqrt(sum((x - mean) ** 2 for x in peers) / (len(peers) - 1)) if len(peers) > 1 else 0.0
            expected = 0.0 if len(set(peers)) == 1 else (r - mean) / (std + 1e-6)
            assert float(san[p, g]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
            assert float(pooled[p, g]) == pytest.approx((r - float(pool_mean[p])) / (float(pool_std[p]) + 1e-6), rel=1e-5)


def test_gae_equals_a_plain_loop() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 1]], dtype=torch.bool)
    adv, ret = gae_advantages(rewards, mask, values_BT=values, gamma=0.9, lam=0.8, whiten=False)
    for b in range(3):
        idx = [t for t in range(6) if mask[b, t]]
        running, following = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[b, t]) + 0.9 * following - float(values[b, t])
            running = delta + 0.9 * 0.8 * running
            following = float(values[b, t])
            assert float(adv[b, t]) == pytest.approx(running, rel=1e-5, abs=1e-6)
            assert float(ret[b, t]) == pytest.approx(running + float(values[b, t]), rel=1e-5, abs=1e-6)


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


def parity(prompt: str, completion: str, **_: object) -> float:
    """A stratum for the end-to-end test: completions of even and odd length."""
    return float(len(completion) % 2)


# what an estimator needs besides its name, end to end
_NEEDS = {
    "stratified": {"algo__advantage_kwargs": '{stratum = "parity"}',
                   "rewards": '[{fn = "tests.test_train:distinct_chars", name = "chars"}, '
                              '{fn = "tests.test_advantages:parity", name = "parity", weight = 0.0}]'},
    "gae": {"algo__advantage_kwargs": "{critic_lr = 1e-3}"},
    "rft": {"algo__advantage_kwargs": "{threshold = 0.5}"},  # the test reward rarely gives full marks
}


@pytest.mark.parametrize("name", sorted([*ESTIMATORS, "gae"]))
def test_two_training_steps_with_every_estimator(name: str, tiny_dir: Path, tmp_path: Path) -> None:
    """Every registered estimator drives real updates end to end (ppo_clip loss)."""
    summary = train(load_config(None, overrides(tiny_dir, tmp_path, f"adv-{name}", algo__advantage=f'"{name}"',
                                                **_NEEDS.get(name, {}))), quiet=True)
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


def test_the_clip_settings_are_the_losss_keywords() -> None:
    from rlvr.train.settings import settings_from_config

    assert settings_from_config(load_config(None, []), []).loss.kwargs == {}  # the loss's own defaults
    cfg = load_config(None, ["algo.loss_kwargs.clip_high=0.3", "algo.loss_kwargs.dual_clip=3.0"])
    assert settings_from_config(cfg, []).loss.kwargs == {"clip_high": 0.3, "dual_clip": 3.0}
    with pytest.raises(ConfigError, match="'gspo': unknown keyword 'dual_clip'"):  # gspo takes no dual_clip
        load_config(None, ['algo.loss="gspo"', "algo.loss_kwargs.dual_clip=3.0"])
    with pytest.raises(ConfigError, match="did you mean 'clip_high'"):
        load_config(None, ["algo.loss_kwargs={clip_hgh = 0.3}"])
    with pytest.raises(ConfigError, match="'algo.clip_high' is now algo.loss_kwargs.clip_high"):
        load_config(None, ["algo.clip_high=0.3"])


def test_bnpo_decomposition_fits_only_the_reward_components() -> None:
    """Flags ("<name>/excluded", "<name>/error") and weight-0 diagnostics (an environment's
    "turns") are reward parts but not rewards: only the components enter the decomposition."""
    from rlvr.train.advantages import advantage_inputs
    from rlvr.train.settings import AdvantageSettings, UpdateSettings
    from rlvr.types import Completion, Group, Sample

    def sample(correct: float, fmt: float) -> Sample:
        parts = {"correct": correct, "format": fmt, "turns": 3.0, "correct/excluded": 1.0, "format/error": 1.0}
        return Sample((1,), Completion((2,), (0.0,), "stop", ""), correct + fmt, parts, 0)

    groups = [Group("p", (sample(1, 0), sample(0, 1))), Group("q", (sample(1, 1), sample(0, 0)))]
    components = UpdateSettings(advantage=AdvantageSettings(reward_components=("correct", "format")))
    parts = advantage_inputs(groups, components).components_KPG()
    torch.testing.assert_close(parts, torch.tensor([[[1.0, 0.0], [1.0, 0.0]], [[0.0, 1.0], [1.0, 0.0]]]))
    everything = advantage_inputs(groups, UpdateSettings())
    assert everything.components == ("correct", "format", "turns")  # without components: no flags, but "turns"
    assert set(everything.parts) == {"correct", "format", "turns", "correct/excluded", "format/error"}


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo", "reinforce_pp", "lite_ppo", "global_pool"])
def test_a_sample_without_a_verdict_leaves_its_groups_statistics_to_the_others(name: str) -> None:
    """A reward that returned None excludes its sample; it took the group's kept mean, which kept
    the mean but narrowed the std (the same squares over G - 1 instead of k - 1): with 1 of 4
    excluded the advantages came out sqrt(3/2) = 1.22 times too large (TRL, which takes the
    statistics over the scored samples, gave 1.00; a comparison in session 21). The kept samples'
    advantages are now those of a group of the three alone."""
    def sample(reward: float, excluded: bool) -> Sample:
        parts = {"r": reward, **({"r/excluded": 1.0} if excluded else {})}
        return Sample((1,), Completion((2,), (-0.1,), "stop", "x"), reward, parts, 0)

    rewards = [1.0, 0.0, 0.0, 0.5]  # the third's "0.0" is no score: its reward gave no verdict
    group = Group("p", tuple(sample(r, i == 2) for i, r in enumerate(rewards)))
    got = compute_advantages([group], UpdateSettings(advantage=AdvantageSettings(name=name)))[0]
    alone = ESTIMATORS[name](torch.tensor([[1.0, 0.0, 0.5]]))[0]
    assert torch.allclose(got[[0, 1, 3]], alone, atol=1e-6)
    if name == "grpo":  # by hand: mean 0.5, sample std 0.5
        assert torch.allclose(got[[0, 1, 3]], torch.tensor([1.0, -1.0, 0.0]), atol=1e-5)


def test_the_ratio_weighted_kl_belongs_in_the_loss(tiny_dir: Path, tmp_path: Path) -> None:
    base = [*overrides(tiny_dir, tmp_path, "x"), 'algo.kl_estimator="k3_ratio"', "algo.kl_coef=0.04"]
    with pytest.raises(ConfigError, match="use it with algo.kl_placement"):
        load_config(None, [*base, 'algo.kl_placement="reward"'])
    assert load_config(None, base).algo.kl_estimator == "k3_ratio"


@pytest.mark.parametrize("name", ["grpo", "reinforce_pp"])
def test_a_group_whose_judged_rewards_are_equal_has_no_advantage_beside_an_excluded_sample(name: str) -> None:
    """Seven kept rewards of 0.7 and one excluded sample, filled with their float32 mean, which
    differs from 0.7 in the last bit: the all-equal test saw eight rewards and missed the group,
    and GRPO's std division blew the 1e-8 residues up to 0.056 on every kept sample (a review)."""
    def sample(excluded: bool) -> Sample:
        parts = {"r": 0.7, **({"r/excluded": 1.0} if excluded else {})}
        return Sample((1,), Completion((2,), (-0.1,), "stop", "x"), 0.7, parts, 0)

    flat = Group("p", tuple(sample(i == 7) for i in range(8)))
    spread = Group("q", tuple(Sample((1,), Completion((2,), (-0.1,), "stop", "x"), r, {"r": r}, 0)
                              for r in (0.0, 1.0, 0.5, 0.25, 0.0, 1.0, 0.5, 0.75)))
    got = compute_advantages([flat, spread], UpdateSettings(advantage=AdvantageSettings(name=name)))
    assert torch.equal(got[0], torch.zeros(8))
