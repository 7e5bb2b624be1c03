"""Prompt-selection samplers (rlvr.data.curricula) against a fake environment whose prompts have
known success rates p_i: a chosen prompt's group is G Bernoulli(p_i) draws with GRPO-normalised
advantages. Each behavioural test compares with what uniform sampling would do."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from rlvr.data.curricula import (
    CURRICULA,
    DUMPSampler,
    MoPPSSampler,
    PCLSampler,
    PrioritizedSampler,
    SamplerContext,
    ScheduleSampler,
    SECSampler,
    build_sampler,
    logistic_sgd_step,
    similarity_predict,
    text_features,
)
from rlvr.data.sampler import UniformSampler
from rlvr.types import Completion, Group, Sample

G = 8
COMPLETION = Completion(token_ids=(1,), logprobs=(0.0,), finish_reason="stop", text="")


def make_group(idx: int, rewards: list[float] | np.ndarray, advantages: list[float] | None = None) -> Group:
    """A group of prompt idx; advantages default to GRPO's (r − mean)/(std + eps)."""
    r = np.asarray(rewards, dtype=float)
    if advantages is None:
        advantages = ((r - r.mean()) / (r.std() + 1e-6)).tolist()
    samples = tuple(Sample(prompt_ids=(0,), completion=COMPLETION, reward=float(x), reward_parts={"correct": float(x)},
                           prompt_index=idx) for x in r)
    return Group(prompt=f"prompt {idx}", samples=samples, accuracy=float(r.mean()), advantages=tuple(advantages))


class FakeEnv:
    """Prompt i succeeds with probability p[i], independently per sample."""

    def __init__(self, p: np.ndarray, seed: int) -> None:
        self.p, self.rng = np.asarray(p, dtype=float), np.random.default_rng(seed)

    def groups(self, indices: list[int]) -> list[Group]:
        return [make_group(i, (self.rng.random(G) < self.p[i]).astype(float)) for i in indices]


def run(sampler, env: FakeEnv, rounds: int, n: int) -> list[list[int]]:
    history = []
    for _ in range(rounds):
        batch = sampler.next_batch(n)
        history.append(batch)
        sampler.observe(env.groups(batch))
    return history


def topic_prompts(seed: int = 0, topics: int = 10, per_topic: int = 20) -> tuple[SamplerContext, np.ndarray]:
    """Prompts in topics that share distinctive words; a topic's success rate ranges from 0.02 to
    0.98 across topics (plus a little per-prompt noise), so text similarity predicts difficulty."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))

    def word() -> str:
        return "".join(rng.choice(letters, 6))

    topic_words = [[word() for _ in range(6)] for _ in range(topics)]
    texts, sources, p = [], [], []
    for t, base in enumerate(np.linspace(0.02, 0.98, topics)):
        for j in range(per_topic):
            words = topic_words[t] + [word() for _ in range(4)]
            rng.shuffle(words)
            texts.append(" ".join(words) + f" number {t * per_topic + j}")
            sources.append(f"topic{t}")
            p.append(float(np.clip(base + rng.normal(0, 0.03), 0, 1)))
    p_P = np.array(p)
    return SamplerContext(texts, sources, seed=1, difficulty=(1 - p_P).tolist()), p_P


def three_sources(per_source: int = 20, seed: int = 0) -> tuple[SamplerContext, np.ndarray]:
    """Sources whose prompts are nearly always solved, learnable (p = 0.5), nearly never solved."""
    sources = ["solved"] * per_source + ["learnable"] * per_source + ["hopeless"] * per_source
    p = np.array([0.97] * per_source + [0.5] * per_source + [0.03] * per_source)
    texts = [f"{s} question {i}" for i, s in enumerate(sources)]
    return SamplerContext(texts, sources, seed=seed, difficulty=(1 - p).tolist()), p


# ----------------------------------------------------------------------------------------------
# behaviour each paper claims


@pytest.mark.parametrize("name, kwargs", [("mopps", {}), ("dots", {"ref_size": 4}), ("pcl", {})])
def test_targeting_samplers_choose_prompts_near_the_target(name: str, kwargs: dict) -> None:
    ctx, p = topic_prompts()
    uniform = run(build_sampler("uniform", ctx), FakeEnv(p, 5), rounds=60, n=16)[30:]
    chosen = run(build_sampler(name, ctx, kwargs), FakeEnv(p, 5), rounds=60, n=16)[30:]
    if name == "dots":  # the first ref_size of each batch are random reference prompts
        chosen = [batch[4:] for batch in chosen]
    gap_uniform = np.mean([abs(p[i] - 0.5) for batch in uniform for i in batch])
    gap = np.mean([abs(p[i] - 0.5) for batch in chosen for i in batch])
    assert gap_uniform > 0.24  # p spread evenly over [0, 1]: mean |p − 0.5| ≈ 0.26
    assert gap < 0.6 * gap_uniform, (name, gap, gap_uniform)


@pytest.mark.parametrize("name, kwargs", [("mopps", {}), ("dots", {"ref_size": 4}), ("pcl", {})])
def test_targeting_samplers_follow_an_asymmetric_target(name: str, kwargs: dict) -> None:
    """Aiming at 0.85 moves the chosen prompts toward easy ones (a predictor that confused
    success with failure would pass at 0.5 but aim at 0.15 here)."""
    ctx, p = topic_prompts()
    chosen = run(build_sampler(name, ctx, {**kwargs, "target": 0.85}), FakeEnv(p, 5), rounds=60, n=16)[30:]
    if name == "dots":
        chosen = [batch[4:] for batch in chosen]
    # uniform: mean |p − 0.85| ≈ 0.38; aiming at 0.15 instead would give ≈ 0.7
    assert np.mean([abs(p[i] - 0.85) for batch in chosen for i in batch]) < 0.2


@pytest.mark.parametrize("name", ["dump", "sec"])
def test_source_bandits_shift_to_the_source_with_the_largest_advantages(name: str) -> None:
    ctx, p = three_sources()
    sampler = build_sampler(name, ctx)
    late = [ctx.sources[i] for batch in run(sampler, FakeEnv(p, 3), rounds=50, n=8)[25:] for i in batch]
    assert late.count("learnable") / len(late) > 0.7  # uniform: 1/3
    probs = sampler.metrics()
    assert probs["p/learnable"] > 0.8
    assert probs["p/learnable"] > probs["p/solved"] + probs["p/hopeless"]


def test_prioritized_draws_failed_prompts_more_often() -> None:
    p = np.linspace(0, 1, 40)
    ctx = SamplerContext([f"q{i}" for i in range(40)], ["default"] * 40, seed=0)
    counts = np.zeros(40)
    for batch in run(build_sampler("prioritized", ctx), FakeEnv(p, 3), rounds=150, n=8):
        counts[batch] += 1
    # weights 1 − s: p ≈ 0.1 vs p ≈ 0.9 is about 9 : 1 (uniform: 1 : 1, 30 draws each)
    assert counts[p < 0.25].mean() > 5 * counts[p > 0.75].mean()


def test_weighted_matches_weights_and_cycles_each_source() -> None:
    sources = ["a"] * 30 + ["b"] * 30 + ["c"] * 40
    ctx = SamplerContext([f"q{i}" for i in range(100)], sources, seed=0)
    sampler = build_sampler("weighted", ctx, {"weights": {"a": 6, "b": 3, "c": 1}})
    drawn = [i for _ in range(100) for i in sampler.next_batch(20)]
    for s, share in {"a": 0.6, "b": 0.3, "c": 0.1}.items():
        assert abs(sum(sources[i] == s for i in drawn) / len(drawn) - share) < 0.03
    counts = np.bincount(drawn, minlength=100)[:30]  # each pass over "a" visits every prompt once
    assert counts.max() - counts.min() <= 1
    assert sampler.epoch == 20.0
    only_a = build_sampler("weighted", ctx, {"weights": {"a": 1.0}})
    assert all(sources[i] == "a" for i in only_a.next_batch(50))


def test_weighted_errors_name_the_sources() -> None:
    ctx = SamplerContext(["x", "y"], ["math", "code"], seed=0)
    with pytest.raises(ValueError, match=r"unknown source 'maths'.*'math', 'code'"):
        build_sampler("weighted", ctx, {"weights": {"maths": 1.0}})
    with pytest.raises(ValueError, match="needs weights"):
        build_sampler("weighted", ctx)
    with pytest.raises(ValueError, match="sum to 0"):
        build_sampler("weighted", ctx, {"weights": {"math": 0.0}})


def test_schedule_goes_from_easy_to_hard() -> None:
    difficulty = np.random.default_rng(0).permutation(30).astype(float)  # prompt i has difficulty rank difficulty[i]
    ctx = SamplerContext([f"q{i}" for i in range(30)], ["default"] * 30, seed=0, difficulty=difficulty.tolist())
    sampler = ScheduleSampler(ctx, stages=3, total_steps=30)
    assert sampler.boundaries == [10, 20]
    assert [sampler.stage(k) for k in (0, 9, 10, 19, 20, 1000)] == [0, 0, 1, 1, 2, 2]
    batches = [sampler.next_batch(6) for _ in range(40)]
    assert all(difficulty[i] < 10 for b in batches[:10] for i in b)  # easiest third: ranks 0–9
    assert all(difficulty[i] < 20 for b in batches[10:20] for i in b)
    assert any(difficulty[i] >= 20 for b in batches[20:] for i in b)
    assert any(difficulty[i] >= 10 for b in batches[10:20] for i in b)
    assert all(len(set(b)) == 6 for b in batches)  # without replacement within the stage's pool
    explicit = ScheduleSampler(ctx, stages=2, boundaries=[3])
    assert all(difficulty[i] < 15 for _ in range(3) for i in explicit.next_batch(6))


def test_schedule_errors() -> None:
    ctx = SamplerContext(["x", "y"], ["d", "d"], seed=0)
    with pytest.raises(ValueError, match="needs a difficulty"):
        build_sampler("schedule", ctx, {"total_steps": 10})
    hard = SamplerContext(["x", "y"], ["d", "d"], seed=0, difficulty=[0.0, 1.0])
    with pytest.raises(ValueError, match="exactly one of total_steps and boundaries"):
        build_sampler("schedule", hard)
    with pytest.raises(ValueError, match="2 increasing"):
        build_sampler("schedule", hard, {"stages": 3, "boundaries": [5]})


# ----------------------------------------------------------------------------------------------
# update rules, by hand


def test_mopps_posterior_update_by_hand() -> None:
    ctx = SamplerContext(["a", "b", "c"], ["d"] * 3, seed=0)
    sampler = MoPPSSampler(ctx, decay=0.5, prior_alpha=1.0, prior_beta=1.0)
    sampler.observe([make_group(0, [1, 1, 1, 0])])  # k = 4, s = 0.75·4 = 3
    # α = 0.5·1 + 0.5·1 + 3 = 4,  β = 0.5·1 + 0.5·1 + (4 − 3) = 2
    assert sampler.alpha_P.tolist() == [4.0, 1.0, 1.0]
    assert sampler.beta_P.tolist() == [2.0, 1.0, 1.0]
    sampler.observe([make_group(0, [1, 0, 0, 0])])  # s = 1
    # α = 0.5·4 + 0.5·1 + 1 = 3.5,  β = 0.5·2 + 0.5·1 + 3 = 4.5
    assert sampler.alpha_P[0] == pytest.approx(3.5, abs=1e-12)
    assert sampler.beta_P[0] == pytest.approx(4.5, abs=1e-12)
    assert sampler.posterior_mean()[0] == pytest.approx(3.5 / 8, abs=1e-12)


def test_dump_ucb_scores_by_hand() -> None:
    ctx = SamplerContext(["x", "y", "z"], ["a", "a", "b"], seed=0)
    sampler = DUMPSampler(ctx, c=1.0, temperature=0.1)
    assert sampler.probabilities() == {"a": 0.5, "b": 0.5}  # both unvisited
    sampler.observe([make_group(0, [1, 0, 1, 0], [1.0, -1.0, 1.0, -1.0])])  # mean |A| = 1.0
    assert sampler.probabilities() == {"a": 0.0, "b": 1.0}  # only b is unvisited
    sampler.observe([make_group(1, [1, 0, 1, 0], [0.5, -0.5, 0.5, -0.5]),  # mean |A| = 0.5
                     make_group(2, [1, 1, 1, 1], [0.0, 0.0, 0.0, 0.0])])  # mean |A| = 0
    # N = 3, n_a = 2, n_b = 1
    # score_a = (1 + 0.5)/2 + sqrt(2 ln 3 / 2) = 0.75 + 1.0481489 = 1.7981471
    # score_b = 0 + sqrt(2 ln 3) = 1.4823038
    scores = sampler.scores()
    assert scores["a"] == pytest.approx(1.7981471, abs=1e-6)
    assert scores["b"] == pytest.approx(1.4823038, abs=1e-6)
    # P(a) = 1 / (1 + exp(−(1.7981471 − 1.4823038)/0.1)) = 0.9592397
    assert sampler.probabilities()["a"] == pytest.approx(0.9592397, abs=1e-6)


def test_dump_window_keeps_the_last_groups() -> None:
    ctx = SamplerContext(["x", "y"], ["a", "b"], seed=0)
    sampler = DUMPSampler(ctx, window=2, c=0.0)
    for adv in (1.0, 0.2, 0.4):
        sampler.observe([make_group(0, [1, 0], [adv, -adv]), make_group(1, [1, 1], [0.0, 0.0])])
    assert sampler.scores()["a"] == pytest.approx((0.2 + 0.4) / 2, abs=1e-12)  # 1.0 fell out


def test_sec_q_update_by_hand() -> None:
    ctx = SamplerContext(["x", "y", "z"], ["a", "a", "b"], seed=0)
    sampler = SECSampler(ctx, alpha=0.5, temperature=0.2)
    sampler.observe([make_group(0, [1, 0], [1.0, -1.0]), make_group(1, [1, 0], [0.5, -0.5])])
    # r_a = (1.0 + 0.5)/2 = 0.75: Q_a = 0.5·0.75 + 0.5·0 = 0.375; b not observed: Q_b = 0
    assert sampler.q == {"a": 0.375, "b": 0.0}
    sampler.observe([make_group(2, [1, 0], [0.8, -0.8]), make_group(0, [1, 0], [0.25, -0.25])])
    # Q_b = 0.5·0.8 + 0.5·0 = 0.4; Q_a = 0.5·0.25 + 0.5·0.375 = 0.3125
    assert sampler.q["a"] == pytest.approx(0.3125, abs=1e-12)
    assert sampler.q["b"] == pytest.approx(0.4, abs=1e-12)
    # P(a) = 1 / (1 + exp((0.4 − 0.3125)/0.2)) = 1 / (1 + e^0.4375) = 0.3923368
    assert sampler.probabilities()["a"] == pytest.approx(0.3923368, abs=1e-6)


def test_prioritized_probabilities_by_hand() -> None:
    ctx = SamplerContext(["w", "x", "y", "z"], ["d"] * 4, seed=0)
    sampler = PrioritizedSampler(ctx, prior=0.5, floor=0.01)
    sampler.observe([make_group(0, [1, 1, 1, 0]), make_group(1, [1, 1, 1, 1])])
    # weights: 1 − 0.75 = 0.25, max(1 − 1, 0.01) = 0.01, unseen 1 − 0.5 = 0.5, 0.5; sum 1.26
    expected = [0.25 / 1.26, 0.01 / 1.26, 0.5 / 1.26, 0.5 / 1.26]
    np.testing.assert_allclose(sampler.probabilities(), expected, atol=1e-12)


def test_dots_similarity_prediction_by_hand() -> None:
    features = np.array([[1.0, 0.0], [0.0, 1.0], [0.6, 0.8]])
    pred = similarity_predict(features, features[:2], np.array([1.0, 0.0]), temperature=0.5)
    # prompt 0: cos = (1, 0) → softmax(2, 0) = (e²/(e²+1), ·) → 0.8807971
    # prompt 2: cos = (0.6, 0.8) → softmax(1.2, 1.6) → weight on ref 0 = 1/(1+e^0.4) = 0.4013123
    np.testing.assert_allclose(pred, [0.8807971, 1 - 0.8807971, 0.4013123], atol=1e-6)


def test_pcl_value_model_step_by_hand() -> None:
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    w, b = logistic_sgd_step(np.zeros(2), 0.0, x, np.array([1.0, 0.0]), lr=0.5, l2=0.0)
    # v = (0.5, 0.5), v − t = (−0.5, 0.5): ∂w = (−0.25, 0.25), ∂b = 0
    np.testing.assert_allclose(w, [0.125, -0.125], atol=1e-12)
    assert b == 0.0
    w, b = logistic_sgd_step(np.array([1.0, 0.0]), 0.0, x, np.array([1.0, 0.0]), lr=0.5, l2=0.1)
    # v = (σ(1), 0.5) = (0.7310586, 0.5), v − t = (−0.2689414, 0.5)
    # ∂w = (−0.1344707 + 0.1, 0.25), ∂b = 0.1155293
    np.testing.assert_allclose(w, [1.0172354, -0.125], atol=1e-6)
    assert b == pytest.approx(-0.0577646, abs=1e-6)


def test_pcl_value_model_learns_the_success_rates() -> None:
    ctx, p = topic_prompts()
    sampler = PCLSampler(ctx)
    run(sampler, FakeEnv(p, 5), rounds=40, n=16)
    pred = sampler.predict(np.arange(len(p)))
    assert np.corrcoef(pred, p)[0, 1] > 0.8


def test_text_features() -> None:
    texts = ["Solve 2 + 2.", "solve   2 + 2.", "Solve 2 + 3.", "Write a poem about the sea"]
    x = text_features(texts, dim=256)
    assert x.shape == (4, 256) and x.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(x, axis=1), 1.0, atol=1e-6)
    np.testing.assert_array_equal(x[0], x[1])  # case and whitespace do not matter
    np.testing.assert_array_equal(x, text_features(texts, dim=256))
    assert x[0] @ x[2] > 0.5 > x[0] @ x[3]


# ----------------------------------------------------------------------------------------------
# properties every sampler has

SETTINGS: dict[str, dict] = {
    "uniform": {},
    "weighted": {"weights": {"solved": 1.0, "learnable": 2.0, "hopeless": 1.0}},
    "prioritized": {},
    "schedule": {"stages": 2, "total_steps": 8},
    "mopps": {},
    "dots": {"ref_size": 2},
    "pcl": {},
    "dump": {},
    "sec": {},
}
NO_DUPLICATES = {"prioritized", "mopps", "dots", "pcl"}


def test_settings_cover_the_registry() -> None:
    assert set(SETTINGS) == set(CURRICULA)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_state_round_trip_reproduces_future_choices(name: str) -> None:
    ctx, p = three_sources(per_source=10)
    a = build_sampler(name, ctx, SETTINGS[name])
    run(a, FakeEnv(p, 1), rounds=6, n=6)
    state = json.loads(json.dumps(a.state_dict()))  # plain JSON types only
    expected = run(a, FakeEnv(p, 2), rounds=6, n=6)
    b = build_sampler(name, ctx, SETTINGS[name])
    b.load_state_dict(state)
    assert run(b, FakeEnv(p, 2), rounds=6, n=6) == expected
    assert b.epoch == a.epoch == 12 * 6 / 30
    assert all(math.isfinite(v) for v in b.metrics().values())


@pytest.mark.parametrize("name", list(SETTINGS))
@pytest.mark.parametrize("n", [1, 5, 12, 17])
def test_batches_have_n_valid_indices(name: str, n: int) -> None:
    ctx, p = three_sources(per_source=4)  # 12 prompts
    for batch in run(build_sampler(name, ctx, SETTINGS[name]), FakeEnv(p, 0), rounds=4, n=n):
        assert len(batch) == n and all(isinstance(i, int) and 0 <= i < 12 for i in batch)
        if name in NO_DUPLICATES and n <= 12:
            assert len(set(batch)) == n


@pytest.mark.parametrize("name", sorted(NO_DUPLICATES))
def test_asking_twice_before_observe_gives_new_prompts(name: str) -> None:
    ctx, p = three_sources(per_source=4)
    sampler = build_sampler(name, ctx, SETTINGS[name])
    first, second = sampler.next_batch(5), sampler.next_batch(5)
    assert not set(first) & set(second)


def test_uniform_is_the_uniform_sampler() -> None:
    ctx, _ = three_sources(per_source=5)
    assert build_sampler("uniform", ctx).next_batch(40) == UniformSampler(15, ctx.seed).next_batch(40)


def test_registry_errors() -> None:
    ctx, _ = three_sources(per_source=2)
    with pytest.raises(ValueError, match=r"unknown sampler 'mops'; did you mean 'mopps'\?.*uniform, weighted"):
        build_sampler("mops", ctx)
    with pytest.raises(ValueError, match=r"sampler 'mopps': unknown keyword 'targt'; did you mean 'target'\?"):
        build_sampler("mopps", ctx, {"targt": 0.5})
    with pytest.raises(ValueError, match="takes no keywords"):
        build_sampler("uniform", ctx, {"seed": 3})
    with pytest.raises(ValueError, match="2 prompts but 1 sources"):
        SamplerContext(["x", "y"], ["d"], seed=0)
