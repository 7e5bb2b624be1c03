"""Rollout strategies (dynamic sampling, Reinforce-Ada, GRPO-RoC), rollout replay and prompt
templates: on a fake engine whose prompts have known success rates, then end to end."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rlvr.config import ConfigError, load_config
from rlvr.data import Example
from rlvr.data.sampler import UniformSampler
from rlvr.rewards import build_rewards
from rlvr.train.collect import ReplayBuffer, Source, dynamic, has_spread, reinforce_ada, roc
from rlvr.train.data import template_variants
from rlvr.train.loop import train
from rlvr.types import Completion, SamplingParams
from tests.test_train import TIMING, overrides, read_metrics


def correct(prompt: str, completion: str, **_: object) -> float:
    return 1.0 if completion.startswith("yes") else 0.0


def tidy(prompt: str, completion: str, **_: object) -> float:
    """A quality score: completions ending in "!" are tidy."""
    return 1.0 if completion.endswith("!") else 0.0


class FakeEngine:
    """Prompt [i] succeeds with probability rates[i]; a success is "yes", and is tidy ("yes!")
    with probability 1/2. Other prompts (templates) are ignored except for their first id."""

    def __init__(self, rates: list[float], seed: int = 0) -> None:
        self.rates, self.rng, self.calls = rates, np.random.default_rng(seed), []

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None) -> list[list[Completion]]:
        self.calls.append((len(prompts), params.n))
        out = []
        for p in prompts:
            rate = self.rates[p[0]]
            texts = ["yes" + ("!" if self.rng.random() < 0.5 else "") if self.rng.random() < rate else "no"
                     for _ in range(params.n)]
            out.append([Completion((5,), (-0.5,), "stop", t) for t in texts])
        return out

    def update_weights(self, state_dict: object) -> None:
        pass


def source(rates: list[float], group: int = 4, quality: bool = False) -> Source:
    examples = [Example(f"q{i}", None, {}, f"p/{i}") for i in range(len(rates))]
    specs = [{"fn": "tests.test_collect:correct", "name": "correct"}]
    if quality:
        specs.append({"fn": "tests.test_collect:tidy", "name": "tidy", "weight": 0.0})
    return Source(FakeEngine(rates), examples, [[i] for i in range(len(rates))], build_rewards(specs),
                  SamplingParams(n=group), UniformSampler(len(rates), seed=1), np.random.default_rng(0))


def test_dynamic_sampling_never_trains_on_a_zero_spread_group_and_refills() -> None:
    rates = [0.0, 1.0] * 6 + [0.5] * 8  # 12 hopeless-or-solved prompts, 8 informative ones
    src = source(rates)
    got = dynamic(src, 4, max_rounds=20)
    assert len(got.train) == 4 and all(has_spread(g) for g in got.train)
    assert {g.samples[0].prompt_index for g in got.train} <= set(range(12, 20))  # only informative prompts
    assert got.metrics["rollouts/rounds"] > 1 and got.metrics["rollouts/filled_fraction"] == 1.0
    assert got.aside and all(not has_spread(g) for g in got.aside if g.samples[0].prompt_index < 12)
    assert got.metrics["rollouts/groups_generated"] == len(got.train) + len(got.aside)


def test_dynamic_sampling_stops_after_max_rounds_when_nothing_has_signal() -> None:
    src = source([0.0, 1.0] * 4)
    got = dynamic(src, 3, max_rounds=2)
    assert got.train == [] and len(got.aside) == 6 and got.metrics["rollouts/rounds"] == 2
    assert got.metrics["rollouts/zero_spread_fraction"] == 1.0


def test_reinforce_ada_spends_its_budget_on_unresolved_prompts_and_keeps_both_outcomes() -> None:
    rates = [0.5, 0.5, 0.95, 0.95]
    src = source(rates, group=4)
    got = reinforce_ada(src, 4, max_rounds=6, exit="balanced")
    sizes = {g.samples[0].prompt_index: len(list(g.pool_rewards or ())) for g in got.train}
    assert all(len(g.samples) == 4 for g in got.train)
    # balanced: 2 correct + 2 incorrect needed; at 95% success that takes far more samples
    assert statistics.fmean(sizes[i] for i in (2, 3)) > statistics.fmean(sizes[i] for i in (0, 1))
    for g in got.train:
        pool = list(g.pool_rewards or ())
        if 0 < sum(pool) < len(pool):  # the pool had both outcomes: so does the group
            assert has_spread(g)
        assert sum(r == 1.0 for r in g.rewards) <= max(2, 4 - pool.count(0.0))
    assert got.metrics["rollouts/samples_per_prompt"] == statistics.fmean(sizes.values())


def test_reinforce_ada_positive_focused_stops_at_the_first_success() -> None:
    src = source([0.3] * 3, group=4)
    got = reinforce_ada(src, 3, round_size=2, max_rounds=20, exit="positive-focused", min_positives=1)
    for g in got.train:
        pool = list(g.pool_rewards or ())
        assert sum(pool) >= 1 and sum(pool[:-2]) == 0  # the last round found the first success
    with pytest.raises(ValueError, match="exit"):
        reinforce_ada(src, 1, exit="greedy")


def test_roc_keeps_group_size_the_success_ratio_and_enough_failures() -> None:
    src = source([0.6] * 6 + [1.0], group=4, quality=True)
    got = roc(src, 7, oversample=4.0, quality=["tidy"], min_negatives=1, min_positives=1)
    assert len(got.aside) == 1 and got.aside[0].samples[0].prompt_index == 6  # all-correct pool: rejected
    for g in got.train:
        pool = list(g.pool_rewards or ())
        assert len(pool) == 16 and len(g.samples) == 4
        kept_pos = sum(x.reward == 1.0 for x in g.samples)
        assert 1 <= kept_pos <= 3  # both outcomes kept (the pool had both)
        assert abs(kept_pos - round(4 * sum(pool) / 16)) <= 1  # about the pool's success ratio
    assert got.metrics["rollouts/rejected_fraction"] == pytest.approx(1 / 7)


def test_roc_prefers_tidy_successes_over_untidy_ones() -> None:
    # one prompt, 16 samples: some tidy successes, untidy successes and failures; keep 4
    src = source([0.7], group=4, quality=True)
    src.engine = FakeEngine([0.7], seed=3)
    pool = src.generate([0], 16)[0]
    tidy_pool = sum(x.completion.text == "yes!" for x in pool.samples)
    src.engine = FakeEngine([0.7], seed=3)  # same pool again
    got = roc(src, 1, oversample=4.0, quality=["tidy"], min_negatives=1, min_positives=1)
    kept = got.train[0].samples
    kept_pos = [x for x in kept if x.completion.text.startswith("yes")]
    assert sum(x.completion.text == "yes!" for x in kept_pos) == min(len(kept_pos), tidy_pool)
    assert any(x.completion.text == "no" for x in kept)


def test_replay_buffer_takes_a_fraction_of_recent_groups_once_and_round_trips() -> None:
    src = source([0.5] * 8)
    groups = [g for g in src.generate(list(range(8))) if has_spread(g)]
    buffer = ReplayBuffer(capacity=5, fraction=0.5, max_age=2)
    buffer.add(groups, step=1)
    assert len(buffer.items) == min(5, len(groups))
    state = buffer.state_dict()
    twin = ReplayBuffer(5, 0.5, 2)
    twin.load_state_dict(state)
    a = buffer.take(4, step=2, rng=np.random.default_rng(1))
    b = twin.take(4, step=2, rng=np.random.default_rng(1))
    assert len(a) == 2 and a == b  # every field round-trips, the accuracy and the pool included
    assert all(g.replay_age == 1 and g.accuracy is not None for g in a)
    assert len(buffer.items) == len(twin.items) == min(5, len(groups)) - 2  # replayed at most once
    assert buffer.take(4, step=4, rng=np.random.default_rng(1)) == []  # too old now
    with pytest.raises(ValueError):
        ReplayBuffer(4, 1.0, 2)


def test_replay_buffer_loads_checkpoints_that_kept_group_values_in_the_metadata() -> None:
    """Checkpoints written before accuracy, pool and staleness were Group fields resume the same."""
    src = source([0.5] * 4)
    group = dataclasses.replace(next(g for g in src.generate(list(range(4))) if has_spread(g)),
                                pool_rewards=(1.0, 0.0, 0.0), staleness=2)
    buffer = ReplayBuffer(capacity=5, fraction=0.5, max_age=2)
    buffer.add([group], step=1)
    (step, state), = buffer.state_dict()["items"]
    old = {"prompt": state["prompt"], "samples": state["samples"],
           "metadata": {**state["metadata"], "accuracy": state["accuracy"], "pool_rewards": [1.0, 0.0, 0.0], "stale": 2}}
    twin = ReplayBuffer(5, 0.5, 2)
    twin.load_state_dict({"items": [(step, old)]})
    assert twin.items == buffer.items and twin.items[0][1].metadata == group.metadata


def test_templates_give_each_rollout_its_own_prompt_and_rewards_the_original() -> None:
    seen: list[str] = []
    examples = [Example("What is 2+2?", None, {}, "x/0")]
    variants = template_variants(["{prompt} Think step by step.", "Answer briefly: {prompt}"],
                                 lambda text: (seen.append(text), [0, len(seen)])[1], examples)
    rows = variants(0, 16, np.random.default_rng(0))
    assert len(rows) == 16 and len({tuple(r) for r in rows}) == 2  # both templates, rendered once each
    assert sorted(seen) == ["Answer briefly: What is 2+2?", "What is 2+2? Think step by step."]
    src = source([1.0])
    src.variants = lambda i, n, rng: [[0, k] for k in range(n)]
    group = src.generate([0])[0]
    assert [x.prompt_ids for x in group.samples] == [(0, k) for k in range(4)] and group.prompt == "q0"
    with pytest.raises(ValueError, match="prompt"):
        template_variants(["no placeholder"], lambda t: [0], examples)


def test_config_rejects_unknown_strategies_keywords_and_templates() -> None:
    with pytest.raises(ConfigError, match="rollouts"):
        load_config(None, ['sampler.rollouts="dapo"'])
    with pytest.raises(ConfigError, match="max_round"):
        load_config(None, ['sampler.rollouts="dynamic"', "sampler.rollouts_kwargs={max_round = 2}"])
    with pytest.raises(ConfigError, match="prompt"):
        load_config(None, ['sampler.templates=["Solve it."]'])


def test_training_with_dynamic_sampling_replay_and_templates_resumes_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    extra = ['sampler.rollouts="dynamic"', "sampler.rollouts_kwargs={max_rounds = 2}",
             "sampler.replay.fraction=0.5", 'sampler.templates=["{prompt}", "Think first. {prompt}"]']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight", train__steps=4), *extra]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "resumed", train__steps=2), *extra]), quiet=True)
    train(resume=tmp_path / "resumed", overrides=("train.steps=4",), quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}
    assert all(r["rollouts/rounds"] >= 1 for r in a)
    replayed = [r for r in a if r["replay/groups"] > 0]
    assert replayed, "later steps replay earlier groups"
    # a replayed group was sampled by an older policy: its PPO ratio moved away from 1
    assert any(abs(r["ratio_mean"] - 1.0) > 1e-4 for r in replayed)
    assert all(r["ratio_mean"] == pytest.approx(1.0, abs=1e-4) for r in a if r["replay/groups"] == 0)


def always_one(prompt: str, completion: str, **_: object) -> float:
    return 1.0


def test_rewards_route_to_their_sources_and_accuracy_uses_the_first_that_applies() -> None:
    from rlvr.rewards.combine import score_group
    from rlvr.train.rollouts import group_metrics, is_correct
    from rlvr.types import Group, Sample

    rewards = build_rewards([
        {"fn": "tests.test_collect:correct", "name": "math", "sources": ["arith"]},
        {"fn": "tests.test_collect:always_one", "name": "code", "sources": ["code"], "source_field": "kind"},
        {"fn": "tests.test_collect:tidy", "name": "tidy", "weight": 0.5},
    ])
    arith = score_group(rewards, "q", ["no!", "yes"], {"kind": "arith", "task": "arith"})
    code = score_group(rewards, "q", ["no!"], {"kind": "code", "task": "code"})
    assert arith == [(0.5, {"math": 0.0, "tidy": 1.0}), (1.0, {"math": 1.0, "tidy": 0.0})]
    assert code == [(1.5, {"code": 1.0, "tidy": 1.0})]  # "math" does not score code prompts at all
    done = Completion((1,), (0.0,), "stop", "x")
    samples = [Sample((0,), done, total, parts, 0) for total, parts in arith + code]
    assert [is_correct(x, "math") for x in samples] == [False, True, True]  # code: judged by "code"
    m = group_metrics([Group("q", tuple(samples))], "math")
    assert m["rewards/math"] == 0.5 and m["rewards/code"] == 1.0  # means over the prompts each scores
    assert m["accuracy"] == pytest.approx(2 / 3)


def test_rlvr_filter_keeps_the_prompts_in_the_pass_rate_band(tiny_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from rlvr.cli import main
    from rlvr.data.filter import Rated, write_filtered

    out = tmp_path / "kept.jsonl"
    args = ["filter", "--model", str(tiny_dir), "--n", "4", "--limit", "6", "--out", str(out),
            'rewards=[{fn = "tests.test_losses:four_distinct"}]', "sampling.max_new_tokens=8",
            "task.params={min_terms = 2, max_terms = 2, max_digits = 1}"]
    assert main(args) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert all(0 < r["pass_rate"] < 1 and r["prompt"] and r["task"] == "chain_sum" for r in rows)
    table = capsys.readouterr().out
    assert table.startswith("pass rate  prompts") and sum(int(line.split()[-1]) for line in table.splitlines()[1:]) == 6
    # the kept prompts, rated again as the help says to train on them; progress counts the file's
    # rows (it had counted task.size's 1000)
    again = ["filter", "--model", str(tiny_dir), "--n", "2", "--out", str(tmp_path / "again.jsonl"),
             'rewards=[{fn = "tests.test_losses:four_distinct"}]', "sampling.max_new_tokens=8", "task.eval_size=0",
             'task.source="jsonl"', f'task.path="{out}"', "task.params={}", 'task.instruction=""']
    assert main(again) == 0
    assert f"rating prompts: {len(rows)}/{len(rows)}" in capsys.readouterr().err
    # the band's edges, by hand
    ex = [Example(f"q{i}", "1", {"task": "t"}, f"id{i}") for i in range(4)]
    rated = [Rated(e, rate) for e, rate in zip(ex, [0.0, 0.25, 0.75, 1.0])]
    assert write_filtered(rated, tmp_path / "a.jsonl", low=0.0, high=1.0) == 2
    assert write_filtered(rated, tmp_path / "b.jsonl", low=0.25, high=1.0, include_low=True, include_high=True) == 3
    with pytest.raises(ValueError, match="low"):
        write_filtered(rated, tmp_path / "c.jsonl", low=0.8, high=0.2)


@pytest.mark.parametrize("name, kwargs", [
    ("mopps", "{}"), ("dots", "{ref_size = 1}"), ("pcl", "{}"), ("dump", "{}"), ("sec", "{}"), ("prioritized", "{}"),
    ("weighted", "{weights = {chain_sum = 1.0}}")])
def test_every_curriculum_trains_and_logs_its_metrics(tiny_dir: Path, tmp_path: Path, name: str, kwargs: str) -> None:
    train(load_config(None, [*overrides(tiny_dir, tmp_path, name), f'sampler.name="{name}"',
                             f"sampler.kwargs={kwargs}"]), quiet=True)
    rows = read_metrics(tmp_path / name)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["epoch"] > 0
    if name != "weighted":
        assert any(k.startswith("sampler/") for k in rows[-1])


def test_an_adaptive_curriculum_with_reinforce_ada_resumes_exactly(tiny_dir: Path, tmp_path: Path) -> None:
    extra = ['sampler.name="dots"', "sampler.kwargs={ref_size = 1}", 'sampler.rollouts="reinforce_ada"',
             "sampler.rollouts_kwargs={max_rounds = 2}", 'algo.advantage="global_pool"']
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "straight", train__steps=4), *extra]), quiet=True)
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "resumed", train__steps=2), *extra]), quiet=True)
    train(resume=tmp_path / "resumed", overrides=("train.steps=4",), quiet=True)
    a, b = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    for ra, rb in zip(a, b, strict=True):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {k: v for k, v in rb.items() if k not in TIMING}
    assert all(r["rollouts/samples_per_prompt"] >= 4 for r in a)


def test_an_unknown_curriculum_fails_before_training(tiny_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="did you mean 'mopps'"):
        train(load_config(None, [*overrides(tiny_dir, tmp_path, "bad"), 'sampler.name="mops"']), quiet=True)
    assert not (tmp_path / "bad").exists()


def test_the_replay_buffer_keeps_every_field_of_an_episode_across_a_checkpoint() -> None:
    import pickle

    from rlvr.train.collect import ReplayBuffer
    from rlvr.types import Completion, Group, Sample

    seg = Completion((5, 6), (-0.5, -0.25), "stop", "ab", loss_mask=(1, 1), turn_index=(0, 0))
    episodes = [Sample((1, 2), Completion((7, 8, 9), (-1.0, 0.0, -2.0), "length", "xyz", loss_mask=(1, 0, 1),
                                          turn_index=(1, 1, 2), policy_version=4), r, {"env": r}, 0, segments=(((3,), seg),))
                for r in (0.0, 1.0)]
    buffer = ReplayBuffer(4, 0.5, 2)
    buffer.add([Group("p", tuple(episodes), {"id": 1})], step=1)
    restored = ReplayBuffer(4, 0.5, 2)
    restored.load_state_dict(pickle.loads(pickle.dumps(buffer.state_dict())))
    assert restored.items == buffer.items


def always_right(prompt: str, completion: str, **_: object) -> float:
    return 1.0


def test_rest_grow_then_improve_trains_on_the_accepted_completions(tiny_dir: Path, tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr filter --accepted` (ReST's Grow step) keeps the distinct finished completions the reward
    accepts, of training prompts only; `rlvr sft` on that file (Improve) learns them."""
    import json

    from rlvr.cli import main
    from rlvr.config import load_config
    from rlvr.train.data import load_examples

    grown = tmp_path / "grown.jsonl"
    task = ["sampling.max_new_tokens=12", 'sampling.stop=["a", "e", "i", "o", "u", "n", "s", "t", "r", "l"]',
            "task.params={min_terms = 2, max_terms = 2, max_digits = 1}", "task.size=40", "task.eval_size=8"]

    def grow(accepted: Path, reward: str) -> int:
        return main(["filter", "--model", str(tiny_dir), "--n", "8", "--limit", "6", "--out",
                     str(tmp_path / "band.jsonl"), "--accepted", str(accepted), f'rewards=[{{fn = "{reward}"}}]', *task])

    assert grow(grown, "tests.test_losses:four_distinct") == 0
    assert "accepted completions of" in capsys.readouterr().err
    rows = [json.loads(line) for line in grown.read_text().splitlines()]
    assert rows, "the tiny model should pass four_distinct sometimes"
    train, held = load_examples(load_config(None, task))
    assert {r["prompt"] for r in rows} <= {ex.prompt for ex in train[:6]}
    assert not {r["prompt"] for r in rows} & {ex.prompt for ex in held}
    assert all(len(set(r["completion"])) >= 4 for r in rows)  # what the reward accepted, nothing else
    assert len({(r["prompt"], r["completion"]) for r in rows}) == len(rows)  # distinct
    for prompt in {r["prompt"] for r in rows}:
        mine = [r for r in rows if r["prompt"] == prompt]
        assert len(mine) <= round(mine[0]["pass_rate"] * 8)
    # a reward that accepts everything keeps every finished completion: more rows, same prompts' ids
    everything = tmp_path / "all.jsonl"
    assert grow(everything, "tests.test_collect:always_right") == 0
    assert len(everything.read_text().splitlines()) > len(rows)
    # Improve: SFT on the grown set
    out = tmp_path / "runs"
    assert main(["sft", f"model={tiny_dir}", f"output_dir={out}", "name=improve", f"sft.data={grown}",
                 "sft.epochs=4", "sft.batch_size=2", "train.lr=3e-3", "sft.eval=false", *task]) == 0
    losses = [json.loads(line)["loss"] for line in (out / "improve" / "metrics.jsonl").read_text().splitlines()]
    assert losses[-1] < losses[0]


def test_write_accepted_rows_by_hand(tmp_path: Path) -> None:
    import json

    from rlvr.data.filter import Rated, write_accepted

    a, b = Example("2 + 3 =", "5", {}, "a"), Example("1 + 1 =", "2", {}, "b")
    rated = [Rated(a, 0.5, ("5", "It is 5")), Rated(b, 0.0), Rated(a, 0.25, ("5",))]  # a's prompt again
    assert write_accepted(rated, tmp_path / "x.jsonl") == 2
    assert [json.loads(line) for line in (tmp_path / "x.jsonl").read_text().splitlines()] == [
        {"prompt": "2 + 3 =", "completion": "5", "id": "a", "pass_rate": 0.5},
        {"prompt": "2 + 3 =", "completion": "It is 5", "id": "a", "pass_rate": 0.5}]
    assert write_accepted(rated, tmp_path / "y.jsonl", system_prompt="Be brief.") == 2
    first = json.loads((tmp_path / "y.jsonl").read_text().splitlines()[0])
    assert first["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 3 ="},
                                 {"role": "assistant", "content": "5"}]


def test_replay_and_its_knobs_are_one_checked_setting() -> None:
    from rlvr.config import ConfigError, load_config

    assert load_config(None, ["sampler.replay.fraction=0.25"]).sampler.replay == {"fraction": 0.25}
    with pytest.raises(ConfigError, match="unknown keyword 'max_ages'; did you mean 'max_age'"):
        load_config(None, ["sampler.replay.fraction=0.25", "sampler.replay.max_ages=2"])
    with pytest.raises(ConfigError, match="needs a fraction > 0"):
        load_config(None, ["sampler.replay.capacity=8"])
    with pytest.raises(ConfigError, match=r"fraction must be in \[0, 1\)"):
        load_config(None, ["sampler.replay.fraction=1.5"])
    with pytest.raises(ConfigError, match="'sampler.replay_fraction' is now sampler.replay.fraction"):
        load_config(None, ["sampler.replay_fraction=0.25"])
