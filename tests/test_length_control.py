"""Length and budget control: staged generation lengths, shaping from a step on, budget-conditioned
and think / no-think prompts, and their rewards, by hand and end to end on the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlvr.data import Example


def test_stage_budget_takes_the_last_stage_begun() -> None:
    from rlvr.train.methods.schedules import stage_budget

    stages = [(1, 64), (10, 128), (30, 256)]
    assert [stage_budget(stages, s, 512) for s in (1, 9, 10, 29, 30, 99)] == [64, 64, 128, 128, 256, 256]
    assert stage_budget([], 5, 512) == 512


@pytest.mark.parametrize("schedule, match", [("[[2, 8]]", "starts at step 1"), ("[[1, 8], [1, 6]]", "higher step"),
                                             ("[[1, 8], [3, 99]]", "outside 1..sampling.max_new_tokens")])
def test_a_length_schedule_that_cannot_be_meant_is_refused(schedule: str, match: str) -> None:
    from rlvr.config import load_config

    with pytest.raises(ValueError, match=match):
        load_config(None, [f"sampling.length_schedule={schedule}", "sampling.max_new_tokens=16"])


def test_staged_lengths_and_late_shaping_follow_the_step(tiny_dir: Path, tmp_path: Path) -> None:
    """Step 1 samples at most 2 tokens and step 2 at most 6 (max_new_tokens 8 is evaluation's);
    the Kimi length shaping set to start at step 2 shapes step 2 alone."""
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from rlvr.train.methods.registry import check
    from tests.test_train import overrides, read_metrics

    extra = ["sampling.length_schedule=[[1, 2], [2, 6]]", "sampling.max_new_tokens=8",
             'algo.shaping=[{fn = "kimi_length", from_step = 2}]']
    summary = train(load_config(None, [*overrides(tiny_dir, tmp_path, "staged"), *extra]), quiet=True)
    samples = [json.loads(line) for line in (tmp_path / "staged" / "samples.jsonl").read_text().splitlines()]
    first = [s["completion_tokens"] for s in samples if s["step"] == 1]
    second = [s["completion_tokens"] for s in samples if s["step"] == 2]
    assert first and max(first) <= 2 and second and max(second) <= 6 and max(second) > 2
    rows = read_metrics(tmp_path / "staged")
    assert "shaping/length_reward_mean" not in rows[0] and "shaping/length_reward_mean" in rows[1]
    assert "schedules" in rows[0]["methods"] and "sampling" in rows[0]["methods"]
    assert summary["eval_after"]["eval/response_length"] > 2  # evaluation keeps the longest budget
    with pytest.raises(ValueError, match="env.name"):
        check(load_config(None, [*overrides(tiny_dir, tmp_path, "x"), *extra, 'env.name="guess_number"']))


def pool(n: int = 30) -> list[Example]:
    return [Example(f"What is {i} + 1?", str(i + 1), {"answer": str(i + 1)}, f"p/{i}") for i in range(n)]


def test_budget_and_mode_prompts_say_what_their_fields_hold() -> None:
    from rlvr.data.control import budget_examples, think_mode_examples
    from rlvr.rewards.styles import PROMPT_MESSAGES

    made = budget_examples(pool(), seed=3, budgets=[16, 64])
    assert made == budget_examples(pool(), seed=3, budgets=[16, 64]) and {ex.fields["budget"] for ex in made} == {16, 64}
    for ex, base in zip(made, pool()):
        assert ex.prompt == f"{base.prompt} Answer in about {ex.fields['budget']} tokens." and ex.id == base.id
    worded = budget_examples(pool(2), seed=0, budgets=[5], template="At most {budget} tokens!")
    assert worded[0].prompt.endswith(" At most 5 tokens!")
    modes = think_mode_examples(pool(), seed=3, no_think_fraction=0.5)
    assert {ex.fields["mode"] for ex in modes} == {"think", "no_think"}
    assert all(ex.prompt.endswith(" /no_think" if ex.fields["mode"] == "no_think" else " /think") for ex in modes)
    assert {ex.fields["mode"] for ex in think_mode_examples(pool(), seed=0, no_think_fraction=1.0)} == {"no_think"}
    chat = Example("hi", "1", {PROMPT_MESSAGES: [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "?"}]}, "c/0")
    asked = budget_examples([chat], seed=0, budgets=[8])[0]
    assert asked.fields[PROMPT_MESSAGES][0]["content"] == "hi Answer in about 8 tokens."
    for bad, match in [({"budgets": []}, "non-empty"), ({"budgets": [0]}, "positive"), ({"budgets": [8.5]}, "positive"),
                       ({"budgets": [8], "template": "short"}, "no {budget}")]:
        with pytest.raises(ValueError, match=match):
            budget_examples(pool(), seed=0, **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="between 0 and 1"):
        think_mode_examples(pool(), seed=0, no_think_fraction=2.0)


def test_budget_reward_by_hand() -> None:
    """budget 10, lengths 10, 5, 20, 40: exact with α = 1/10 gives 0, −0.5, −1, −3 stopped at −1;
    max charges only the lengths over it; α = 0.01 per token gives 0, −0.05, −0.1, −0.3."""
    from rlvr.rewards.length import budget_reward

    ids = [[1] * n for n in (10, 5, 20, 40)]
    texts = ["x"] * 4
    assert budget_reward("p", texts, budget=10, completion_ids=ids) == pytest.approx([0.0, -0.5, -1.0, -1.0])
    assert budget_reward("p", texts, budget=10, completion_ids=ids, mode="max") == pytest.approx([0.0, 0.0, -1.0, -1.0])
    assert budget_reward("p", texts, budget=10, completion_ids=ids, alpha=0.01) == pytest.approx([0, -0.05, -0.1, -0.3])
    assert budget_reward("p", texts, budget=10, completion_ids=ids, floor=-2.0) == pytest.approx([0, -0.5, -1, -2])
    for kwargs, match in [({"completion_ids": None}, "token ids"), ({"mode": "near"}, "mode"),
                          ({"budget": 0}, "positive")]:
        with pytest.raises(ValueError, match=match):
            budget_reward("p", texts, **{"budget": 10, "completion_ids": ids, **kwargs})  # type: ignore[arg-type]


@pytest.mark.parametrize("mode, text, value", [
    ("think", "<think>3 + 4 is 7</think> 7", 1.0), ("think", "7", 0.0), ("think", "<think> </think> 7", 0.0),
    ("think", "<think>3 + 4 is 7, so 7", 0.0),  # a block never closed: the answer is still inside it
    ("no_think", "7", 1.0), ("no_think", "<think></think>7", 1.0), ("no_think", "<think>hm</think>7", 0.0),
    ("no_think", "<think>hm 7", 0.0)])
def test_think_mode_reward_checks_the_mode_was_followed(mode: str, text: str, value: float) -> None:
    from rlvr.rewards.length import think_mode_reward

    assert think_mode_reward("p", text, mode=mode) == value


def test_think_mode_reward_refuses_an_unknown_mode() -> None:
    from rlvr.rewards.length import think_mode_reward

    with pytest.raises(ValueError, match="think_mode"):
        think_mode_reward("p", "7", mode="fast")


def test_a_budget_task_trains_on_the_tiny_model(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    rewards = 'rewards=[{fn = "tests.test_train:distinct_chars", name = "chars"}, {fn = "budget", weight = 0.5}]'
    train(load_config(None, [*overrides(tiny_dir, tmp_path, "budget"), 'task.transforms=[{fn = "budget", kwargs = {budgets = [2, 6]}}, {fn = "think_mode"}]', rewards]), quiet=True)
    rows = read_metrics(tmp_path / "budget")
    assert all(-1.0 <= r["rewards/budget"] <= 0.0 for r in rows)
    samples = [json.loads(line) for line in (tmp_path / "budget" / "samples.jsonl").read_text().splitlines()]
    assert all(" Answer in about " in s["prompt"] and s["prompt"].endswith(("/think", "/no_think")) for s in samples)
    from rlvr.train.data import load_examples

    with pytest.raises(ValueError, match="'budget'"):
        load_examples(load_config(None, ['task.transforms=[{fn = "budget", kwargs = {budget = 3}}]']))
    # a user's own builder, by dotted path, after a built-in one
    own = load_examples(load_config(None, ['task.transforms=[{fn = "budget", kwargs = {budgets = [4]}}, '
                                           '{fn = "tests.test_length_control:shouted"}]', "task.eval_size=2"]))[0]
    assert all(ex.prompt.endswith("ABOUT 4 TOKENS.") for ex in own)


def shouted(examples: list[Example], *, seed: int) -> list[Example]:
    return [Example(ex.prompt.upper(), ex.answer, ex.fields, ex.id) for ex in examples]
