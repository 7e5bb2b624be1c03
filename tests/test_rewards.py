"""Answer extraction, built-in rewards, reward loading and weighted scoring."""

from __future__ import annotations

import logging
import math
import threading
from pathlib import Path
from typing import Any

import pytest
import reasoning_gym

from rlvr.rewards import (
    EXTRACTORS,
    build_rewards,
    extract_answer,
    format_reward,
    load_callable,
    math_verify_reward,
    reasoning_gym_reward,
    score,
)
from rlvr.rewards.combine import RewardFn

# --- extraction -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so <answer> 42 </answer>", "42"),
        ("<answer>1</answer> wait, no: <answer>2</answer>", "2"),
        ("<answer>multi\nline</answer>", "multi\nline"),
        ("<answer></answer>", ""),
        ("no tags at all", None),
        ("<answer>unclosed", None),
        ("</answer> close before open", None),
    ],
)
def test_extract_tag(text: str, expected: str | None) -> None:
    assert extract_answer(text, "tag") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"thus \boxed{7}.", "7"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{1} then \boxed{x^{2}+\sqrt{y}}", r"x^{2}+\sqrt{y}"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\boxed{\frac{1}{2}", None),  # truncated: the last box never closes
        ("no box", None),
    ],
)
def test_extract_boxed(text: str, expected: str | None) -> None:
    assert extract_answer(text, "boxed") == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("3 apples and 4 pears make 7.", "7"),
        ("the result is -12", "-12"),
        ("x = -0.25 or so", "-0.25"),
        ("about 3.14159", "3.14159"),
        ("total: $1,234,567.89", "1234567.89"),
        ("the list 1,2,3", "3"),  # not a thousands separator
        ("pages 10-15", "15"),  # subtraction, not a negative number
        ("no digits", None),
    ],
)
def test_extract_last_number(text: str, expected: str | None) -> None:
    assert extract_answer(text, "last_number") == expected


def test_extract_tag_or_last_number() -> None:
    assert extract_answer("<answer>5</answer> 6", "tag_or_last_number") == "5"
    assert extract_answer("it is 6", "tag_or_last_number") == "6"
    assert extract_answer("nothing", "tag_or_last_number") is None


def test_extract_unknown_format_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="xml") as info:
        extract_answer("x", "xml")
    assert all(name in str(info.value) for name in EXTRACTORS)


# --- built-in rewards -------------------------------------------------------------------


@pytest.fixture(scope="module")
def chain_sum_entry() -> dict[str, Any]:
    dataset = reasoning_gym.create_dataset(
        "chain_sum", size=1, seed=1, min_terms=2, max_terms=2, min_digits=1, max_digits=1
    )
    return dataset[0]


def test_reasoning_gym_reward(chain_sum_entry: dict[str, Any]) -> None:
    gold = chain_sum_entry["answer"]
    wrong = str(int(gold) + 1)
    fields: dict[str, Any] = {"task": "chain_sum", "entry": chain_sum_entry}
    assert reasoning_gym_reward("q", f"think <answer>{gold}</answer>", **fields) == 1.0
    assert reasoning_gym_reward("q", f"<answer>{wrong}</answer>", **fields) == 0.0
    assert reasoning_gym_reward("q", f"the answer is {gold}", **fields) == 0.0  # no tag
    untagged = f"the answer is {gold}"
    assert reasoning_gym_reward("q", untagged, extract="last_number", **fields) == 1.0


def test_math_verify_reward() -> None:
    assert math_verify_reward("q", r"<answer>\frac{1}{2}</answer>", answer="0.5") == 1.0
    assert math_verify_reward("q", "<answer>0.6</answer>", answer="0.5") == 0.0
    assert math_verify_reward("q", "<answer>1+x</answer>", answer="x+1") == 1.0
    assert math_verify_reward("q", "<answer>1</answer>", answer="x+1") == 0.0
    assert math_verify_reward("q", r"so \boxed{1,000}", answer="1000", extract="boxed") == 1.0
    # Strict: a correct value outside the expected format earns nothing.
    assert math_verify_reward("q", "it is 0.5", answer="0.5") == 0.0


def test_math_verify_reward_off_the_main_thread() -> None:
    # math-verify's default timeouts use signal.alarm, which raises in a worker thread.
    results: list[float] = []
    thread = threading.Thread(
        target=lambda: results.append(
            math_verify_reward("q", r"<answer>\frac{1}{2}</answer>", answer="0.5")
        )
    )
    thread.start()
    thread.join()
    assert results == [1.0]


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("reasoning <answer>4</answer>", 1.0),
        ("<answer>  </answer>", 0.0),
        ("<answer>4</answer><answer>5</answer>", 0.0),
        ("</answer>4<answer>", 0.0),
        ("4", 0.0),
    ],
)
def test_format_reward(completion: str, expected: float) -> None:
    assert format_reward("q", completion) == expected


# --- loading and combining --------------------------------------------------------------


def length_reward(prompt: str, completion: str, **_: Any) -> float:
    return float(len(completion))


def test_load_callable_builtin_and_dotted_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def shout(prompt, completion, **_):\n    return float(completion.isupper())\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_callable("format") is format_reward
    assert load_callable("my_rewards:shout")("q", "HI") == 1.0
    assert load_callable("my_rewards.shout")("q", "hi") == 0.0
    with pytest.raises(ValueError, match="not callable"):
        load_callable("my_rewards:NOT_CALLABLE")
    with pytest.raises(ValueError, match="has no attribute 'shuot'.*'shout'"):
        load_callable("my_rewards:shuot")
    with pytest.raises(ValueError, match="cannot import module 'no_such_module'"):
        load_callable("no_such_module:fn")


def test_load_callable_unknown_builtin_suggests_nearest() -> None:
    with pytest.raises(ValueError, match="Did you mean 'math_verify'") as info:
        load_callable("math_verfy")
    assert "reasoning_gym" in str(info.value)  # lists the built-ins


def test_build_rewards_names_and_errors() -> None:
    rewards = build_rewards(
        [{"fn": "format"}, {"fn": f"{__name__}:length_reward", "weight": 0.5, "kwargs": {"x": 1}}]
    )
    assert [(r.name, r.weight, r.kwargs) for r in rewards] == [
        ("format", 1.0, {}),
        ("length_reward", 0.5, {"x": 1}),
    ]
    with pytest.raises(ValueError, match="named 'format'"):
        build_rewards([{"fn": "format"}, {"fn": "format"}])
    with pytest.raises(ValueError, match="needs 'fn'"):
        build_rewards([{"fn": "format", "wieght": 2.0}])


def test_score_weighted_sum_and_per_reward_values() -> None:
    rewards = build_rewards(
        [{"fn": "format", "weight": 0.2}, {"fn": f"{__name__}:length_reward", "weight": 0.5}]
    )
    completion = "<answer>7</answer>"  # 18 characters, well formatted
    total, values = score(rewards, "q", completion, {"answer": "7"})
    assert values == {"format": 1.0, "length_reward": 18.0}
    assert total == pytest.approx(0.2 * 1.0 + 0.5 * 18.0)  # = 9.2


def test_score_passes_example_fields_and_kwargs_override_them() -> None:
    seen: dict[str, Any] = {}

    def spy(prompt: str, completion: str, **example: Any) -> float:
        seen.update(example)
        return True  # a bool counts as a number

    rewards = [RewardFn("spy", spy, 2.0, {"tag": "b"})]
    total, values = score(rewards, "q", "c", {"answer": "7", "tag": "a"})
    assert seen == {"answer": "7", "tag": "b"}
    assert (total, values) == (2.0, {"spy": 1.0})


def test_score_contains_failing_rewards(caplog: pytest.LogCaptureFixture) -> None:
    def boom(prompt: str, completion: str, **_: Any) -> float:
        raise KeyError("missing field")

    rewards = [
        RewardFn("ok", lambda p, c, **_: 1.0, 1.0, {}),
        RewardFn("boom", boom, 1.0, {}),
        RewardFn("nan", lambda p, c, **_: math.nan, 1.0, {}),
        RewardFn("text", lambda p, c, **_: "1.0", 1.0, {}),
    ]
    with caplog.at_level(logging.WARNING, logger="rlvr.rewards"):
        for _ in range(3):
            total, values = score(rewards, "q", "c", {})
    assert total == 1.0
    assert values == {
        "ok": 1.0,
        "boom": 0.0, "boom/error": 1.0,
        "nan": 0.0, "nan/error": 1.0,
        "text": 0.0, "text/error": 1.0,
    }  # fmt: skip
    # One warning per (reward, failure kind), not one per call.
    assert len(caplog.records) == 3
    assert "KeyError" in caplog.text and "missing field" in caplog.text


def no_verdict_on_x(prompt: str, completion: str, **_: Any) -> float | None:
    return None if "x" in completion else 1.0


def no_verdict_on_odd_length(prompt: str, completion: str, **_: Any) -> float | None:
    """No verdict for about half the completions, whatever the seed samples."""
    return None if len(completion) % 2 else 1.0


def sleepy(prompt: str, completion: str, **_: Any) -> float:
    import time

    time.sleep(3)
    return 1.0


def broken(prompt: str, completion: str, **_: Any) -> float:
    raise RuntimeError("reward exploded")


def test_none_excludes_the_sample_and_failures_follow_the_policy() -> None:
    from rlvr.rewards.combine import RewardError, build_rewards, score

    rewards = build_rewards([{"fn": "tests.test_rewards:no_verdict_on_x"}])
    total, parts = score(rewards, "p", "has x", {})
    assert total == 0.0 and parts == {"no_verdict_on_x": 0.0, "no_verdict_on_x/excluded": 1.0}
    assert score(rewards, "p", "fine", {}) == (1.0, {"no_verdict_on_x": 1.0})
    bad = build_rewards([{"fn": "tests.test_rewards:broken"}])
    assert score(bad, "p", "c", {})[1] == {"broken": 0.0, "broken/error": 1.0}
    with pytest.raises(RewardError, match="(?s)reward 'broken' failed.*'the completion'.*reward exploded"):
        score(bad, "p", "the completion", {}, on_error="stop")


def test_a_reward_past_its_timeout_is_a_failure_and_nothing_hangs() -> None:
    import time

    from rlvr.rewards.combine import USER_TIMEOUT_S, build_rewards, score

    slow = build_rewards([{"fn": "tests.test_rewards:sleepy", "timeout_s": 0.2}])
    start = time.monotonic()
    assert score(slow, "p", "c", {})[1] == {"sleepy": 0.0, "sleepy/error": 1.0}
    assert time.monotonic() - start < 2.5  # returned at the timeout, not after the 3 s sleep
    assert build_rewards([{"fn": "tests.test_rewards:sleepy"}])[0].timeout_s == USER_TIMEOUT_S
    assert build_rewards([{"fn": "math_verify"}])[0].timeout_s is None  # built-ins bound their own time


def test_excluded_samples_stay_out_of_the_update(tiny_dir: Path, tmp_path: Path) -> None:
    import json

    from rlvr.config import load_config
    from rlvr.train.loop import train

    cfg = load_config(None, [
        f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "name=ex", "train.steps=2", "train.prompts_per_step=4",
        "algo.group_size=4", "sampling.max_new_tokens=8", "train.lr=1e-3", "task.eval_size=2", "seed=3",
        'task.params={min_terms = 2, max_terms = 2, max_digits = 1}',
        'rewards=[{fn = "tests.test_train:distinct_chars"}, {fn = "tests.test_rewards:no_verdict_on_odd_length", weight = 0}]'])
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "ex" / "metrics.jsonl").read_text().splitlines()]
    samples = [json.loads(line) for line in (tmp_path / "ex" / "samples.jsonl").read_text().splitlines()]
    excluded = [s for s in samples if "no_verdict_on_odd_length/excluded" in s["rewards"]]
    assert 0 < len(excluded) < len(samples)
    assert sum(r["excluded_fraction"] for r in rows) * 16 == pytest.approx(len(excluded))
    for r, step in zip(rows, (1, 2)):  # excluded samples are never trained
        n_excl = sum(1 for s in excluded if s["step"] == step)
        assert r["trained_fraction"] <= 1 - n_excl / 16 + 1e-9


def test_majority_vote_by_hand() -> None:
    from rlvr.rewards.builtin import majority_vote_reward

    group = ["<answer>7</answer>", "it is 7", "<answer> 8 </answer>", "no idea", "<answer>7</answer>"]
    assert majority_vote_reward("p", group) == [1.0, 1.0, 0.0, 0.0, 1.0]
    assert majority_vote_reward("p", ["<answer>3</answer>", "<answer>4</answer>"]) == [1.0, 0.0]  # tie: first seen
    assert majority_vote_reward("p", ["nothing", "at all"]) == [0.0, 0.0]


def bad_group(prompt: str, completions: list[str], **_: Any) -> list[float]:
    return [1.0]  # one value for several completions


def test_group_rewards_are_called_once_per_group_and_checked() -> None:
    from rlvr.rewards.combine import build_rewards, score_group

    rewards = build_rewards([{"fn": "majority_vote"}, {"fn": "format", "weight": 0.5}])
    assert rewards[0].group and not rewards[1].group
    out = score_group(rewards, "p", ["<answer>1</answer>", "1", "<answer>2</answer>"], {})
    assert [t for t, _ in out] == [1.5, 1.0, 0.5]
    assert out[2][1] == {"majority_vote": 0.0, "format": 1.0}
    wrong = build_rewards([{"fn": "tests.test_rewards:bad_group", "group": True}])
    assert [p for _, p in score_group(wrong, "p", ["a", "b"], {})] == [{"bad_group": 0.0, "bad_group/error": 1.0}] * 2


def test_training_with_majority_vote_logs_the_collapse_monitor(tiny_dir: Path, tmp_path: Path) -> None:
    import json

    from rlvr.config import load_config
    from rlvr.train.loop import train

    cfg = load_config(None, [
        f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "name=ttrl", "train.steps=2", "train.prompts_per_step=2",
        "algo.group_size=4", "sampling.max_new_tokens=8", "task.eval_size=2",
        'rewards=[{fn = "majority_vote", kwargs = {extract = "last_number"}}]'])
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "ttrl" / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["distinct_completion_fraction"] <= 1 and "rewards/majority_vote" in r for r in rows)
    assert all(0 < r["distinct_answer_fraction"] <= r["distinct_completion_fraction"] for r in rows)


async def async_length(prompt: str, completion: str, **_: Any) -> float:
    import asyncio

    await asyncio.sleep(0)
    return float(len(completion))


def test_async_rewards_are_awaited() -> None:
    from rlvr.rewards.combine import build_rewards, score

    assert score(build_rewards([{"fn": "tests.test_rewards:async_length"}]), "p", "abcd", {}) == \
        (4.0, {"async_length": 4.0})
    with_timeout = build_rewards([{"fn": "tests.test_rewards:async_length", "timeout_s": 5}])
    assert score(with_timeout, "p", "ab", {})[0] == 2.0


def test_intrinsic_certainty_equals_the_naive_computation() -> None:
    import torch

    from rlvr.rewards.intrinsic import token_certainty
    from tests.tiny import make_tiny_model

    model = make_tiny_model().eval()
    ids = torch.tensor([[5, 6, 7, 8, 9], [5, 6, 10, 0, 0]])
    attention = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    target = torch.tensor([[0, 0, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool)
    cert, neg_ent = token_certainty(model, ids, attention, target, temperature=0.7, chunk_size=2)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits.float() / 0.7, -1)
    vocab = logp.shape[-1]
    for b, positions in ((0, [1, 2, 3]), (1, [1])):  # position t-1 predicts target token t
        kl_uniform = [float(-logp[b, t].mean() - math.log(vocab)) for t in positions]
        entropy = [float(-(logp[b, t].exp() * logp[b, t]).sum()) for t in positions]
        assert float(cert[b]) == pytest.approx(sum(kl_uniform) / len(positions), abs=1e-4)
        assert float(neg_ent[b]) == pytest.approx(-sum(entropy) / len(positions), abs=1e-4)
    assert (cert >= 0).all() and (neg_ent <= 0).all()


def test_training_on_self_certainty_alone(tiny_dir: Path, tmp_path: Path) -> None:
    import json

    from rlvr.config import load_config
    from rlvr.rewards.combine import build_rewards
    from rlvr.train.loop import train

    with pytest.raises(ValueError, match="takes no kwargs"):
        build_rewards([{"fn": "self_certainty", "kwargs": {"x": 1}}])
    cfg = load_config(None, [
        f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "name=rlif", "train.steps=2", "train.prompts_per_step=2",
        "algo.group_size=4", "sampling.max_new_tokens=8", "task.eval_size=2", "train.lr=1e-3",
        'rewards=[{fn = "self_certainty"}, {fn = "negative_entropy", weight = 0.0}]'])
    train(cfg, quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "rlif" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["rewards/self_certainty"] > 0 and r["rewards/negative_entropy"] < 0 for r in rows)
    assert all(r["grad_norm"] > 0 for r in rows)  # the rewards vary within groups: there is a gradient
    samples = [json.loads(line) for line in (tmp_path / "rlif" / "samples.jsonl").read_text().splitlines()]
    assert all(s["reward"] == pytest.approx(s["rewards"]["self_certainty"]) for s in samples)


def test_distinct_answer_fraction_by_hand() -> None:
    from rlvr.train.rollouts import group_metrics
    from rlvr.types import Completion, Group, Sample

    def group(texts: list[str]) -> Group:
        return Group("p", tuple(Sample((1,), Completion((2,), (-0.1,), "stop", t), 0.0, {"r": 0.0}, 0) for t in texts))

    # answers 7, 7, 8 | None, None, 5, 5 -> 2/3 and 2/4
    m = group_metrics([group(["<answer>7</answer>", "so 7", "it is 8"]), group(["hm", "eh", "5", "5"])], "r")
    assert m["distinct_answer_fraction"] == pytest.approx((2 / 3 + 2 / 4) / 2)
    assert m["distinct_completion_fraction"] == pytest.approx((3 / 3 + 3 / 4) / 2)


def unavailable(prompt: str, completion: str, **_: Any) -> float:
    from rlvr.errors import InfrastructureError

    raise InfrastructureError("the judge service is down")


def test_an_infrastructure_failure_is_an_excluded_error_never_a_zero(caplog: pytest.LogCaptureFixture) -> None:
    from rlvr.errors import InfrastructureError
    from rlvr.rewards.combine import RewardError, RewardFn, build_rewards, score, score_group

    rewards = build_rewards([{"fn": "tests.test_rewards:unavailable"}, {"fn": "format"}])
    with caplog.at_level(logging.WARNING, logger="rlvr.rewards"):
        for _ in range(3):
            total, parts = score(rewards, "p", "<think>a</think><answer>1</answer>", {})
    assert parts == {"unavailable": 0.0, "unavailable/error": 1.0, "unavailable/excluded": 1.0, "format": 1.0}
    assert len(caplog.records) == 1 and "excluding the sample" in caplog.text and "judge service is down" in caplog.text
    with pytest.raises(RewardError, match="infrastructure"):
        score(rewards, "p", "c", {}, on_error="stop")
    # a group reward marks the one completion it could not judge; the others keep their verdicts
    group = RewardFn("g", lambda p, cs, **_: [1.0, InfrastructureError("no sandbox slot"), 0.0], 1.0, {}, group=True)
    scored = [parts for _, parts in score_group([group], "p", ["a", "b", "c"], {})]
    assert scored == [{"g": 1.0}, {"g": 0.0, "g/error": 1.0, "g/excluded": 1.0}, {"g": 0.0}]


def test_a_code_reward_whose_sandbox_cannot_start_excludes_the_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr import sandbox
    from rlvr.rewards.combine import build_rewards, score_group

    sandbox.check_isolation("auto")
    monkeypatch.setattr(sandbox, "_PRLIMIT", "/usr/bin/no-such-prlimit")  # every run fails to start
    monkeypatch.setattr(sandbox, "_BACKOFF_S", 0.01)
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    scored = score_group(build_rewards([{"fn": "unit_tests"}]), "p", [code, "no code"], {"tests": ["assert add(1, 2) == 3"]})
    assert [parts for _, parts in scored] == [
        {"unit_tests": 0.0, "unit_tests/error": 1.0, "unit_tests/excluded": 1.0},
        {"unit_tests": 0.0}]  # no code at all is the completion's failure: a plain 0


def test_math_verify_reads_an_answer_in_markdown_or_display_math() -> None:
    """Found scored 0 by a red-team review (session 19): LaTeX read `**42**` as something else."""
    for answer in ("**42**", "`42`", "``42``", "__42__", r"\[42\]", r"\(42\)", "42"):
        assert math_verify_reward("", f"<answer>{answer}</answer>", answer="42") == 1.0, answer
    for answer in ("**43**", "**3** or **4**", "`41`"):
        assert math_verify_reward("", f"<answer>{answer}</answer>", answer="42") == 0.0, answer


def test_majority_vote_counts_a_number_by_its_value_and_format_wants_a_visible_answer() -> None:
    """Found by a red-team review (session 19): "12.0" and "12" split a real majority, and a
    zero-width space counted as an answer."""
    from rlvr.rewards.builtin import majority_vote_reward

    group = ["<answer>12.0</answer>", "<answer>12</answer>", "<answer>13</answer>", "<answer>1,2</answer>"]
    assert majority_vote_reward("", group) == [1.0, 1.0, 0.0, 0.0]
    assert majority_vote_reward("", ["<answer>1,200</answer>", "<answer>1200</answer>", "<answer>x</answer>"]) == [1.0, 1.0, 0.0]
    assert format_reward("", "<answer>\u200b</answer>") == 0.0 and format_reward("", "<answer>\u200b7</answer>") == 1.0


def test_a_service_a_reward_calls_being_down_is_not_the_completions_fault() -> None:
    """A user reward raising ConnectionError (its judge unreachable) scored 0 and was trained on as
    a bad answer (a review, session 19): it is excluded now, like an InfrastructureError. Running
    past timeout_s stays a failure scored 0."""
    import time
    import urllib.error

    def unreachable(prompt: str, completion: str, **_: Any) -> float:
        raise ConnectionError("judge service unreachable")

    def no_route(prompt: str, completion: str, **_: Any) -> float:
        raise urllib.error.URLError("no route to host")

    def slow(prompt: str, completion: str, **_: Any) -> float:
        time.sleep(0.5)
        return 1.0

    rewards = [RewardFn("judge", unreachable, 1.0, {}), RewardFn("route", no_route, 1.0, {}),
               RewardFn("slow", slow, 1.0, {}, timeout_s=0.05)]
    _, parts = score(rewards, "q", "c", {})
    assert parts["judge/excluded"] == parts["judge/error"] == 1.0 and parts["route/excluded"] == 1.0
    assert parts["slow"] == 0.0 and parts["slow/error"] == 1.0 and "slow/excluded" not in parts
