"""Rewards and data written for TRL and verl: TRL's own reward functions (from the installed
`trl` package), TRL- and verl-style functions and datasets written here as their docs lay them
out, loaded and scored by rlvr unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlvr.data.tasks import jsonl_examples, parquet_examples, render_example
from rlvr.rewards.combine import build_rewards, score_group
from rlvr.rewards.styles import PROMPT_MESSAGES, detect_style
from tests.tiny import make_tiny_tokenizer

CALLS: list[dict[str, Any]] = []


def trl_length_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                      solution: list[str], **kwargs: Any) -> list[float | None]:
    """A TRL-style reward (standard format): records what it was given; None where the solution is "?"."""
    CALLS.append({"prompts": prompts, "completions": completions, "completion_ids": completion_ids,
                  "solution": solution, "kwargs": sorted(kwargs)})
    return [None if s == "?" else float(len(c)) for c, s in zip(completions, solution)]


async def trl_async_reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0 if "b" in (c if isinstance(c, str) else c[0]["content"]) else 0.0 for c in completions]


def trl_wrong_length(completions: list[str], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)


def gsm8k_style_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None) -> dict:
    """A verl-style compute_score (verl's docs: data_source, solution_str, ground_truth, extra_info):
    the number after '####', as GSM8K's answers write it; a dict with "score" and an extra value."""
    CALLS.append({"data_source": data_source, "ground_truth": ground_truth, "extra_info": extra_info})
    answer = solution_str.split("####")[-1].strip() if "####" in solution_str else None
    return {"score": 1.0 if answer == ground_truth else 0.0, "format_ok": answer is not None, "pred": answer,
            "excluded": 2.5}  # a name rlvr's flags use: renamed


def verl_without_extra_info(data_source: str, solution_str: str, ground_truth: str) -> float:
    return float(ground_truth in solution_str)


def verl_scaled_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                      correct: float = 1.0, format_score: float = 0.0) -> float:
    """verl's gsm8k `compute_score` takes `format_score` and `score` the same way, set through
    `custom_reward_function.reward_kwargs`."""
    if "####" not in solution_str:
        return 0.0
    return correct if solution_str.split("####")[-1].strip() == ground_truth else format_score


def verl_with_var_kwargs(data_source: str, solution_str: str, ground_truth: str, **kwargs: Any) -> float:
    CALLS.append(kwargs)
    return 1.0


def rlvr_reward(prompt: str, completion: str, **row: Any) -> float:
    return 0.5


def rlvr_group_reward(prompt: str, completions: list[str], **row: Any) -> list[float]:
    return [0.5] * len(completions)


def test_the_style_is_read_from_the_signature() -> None:
    import trl.rewards

    assert detect_style(trl_length_reward) == detect_style(trl_async_reward) == "trl"
    assert detect_style(trl.rewards.accuracy_reward) == detect_style(trl.rewards.think_format_reward) == "trl"
    assert detect_style(gsm8k_style_score) == detect_style(verl_without_extra_info) == "verl"
    assert detect_style(rlvr_reward) == detect_style(rlvr_group_reward) == "rlvr"  # rlvr's group rewards stay rlvr's
    with pytest.raises(ValueError, match="style must be one of"):
        build_rewards([{"fn": "tests.test_interop_rewards:rlvr_reward", "style": "openrlhf"}])


def test_a_trl_reward_gets_lists_columns_ids_and_its_none_gives_no_value() -> None:
    CALLS.clear()
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:trl_length_reward"},
                             {"fn": "tests.test_interop_rewards:rlvr_reward"}])
    assert rewards[0].group and rewards[0].wants_completion_ids
    out = score_group(rewards, "Q?", ["ab", "abcd"], {"solution": "2", "level": 3}, completion_ids=[(5, 6), (5, 6, 7, 8)])
    call = CALLS[-1]
    assert call["prompts"] == ["Q?", "Q?"] and call["completions"] == ["ab", "abcd"]
    assert call["completion_ids"] == [[5, 6], [5, 6, 7, 8]] and call["solution"] == ["2", "2"]
    assert {"level", "trainer_state", "log_extra", "log_metric"} <= set(call["kwargs"])
    assert [total for total, _ in out] == [2.5, 4.5]
    # TRL's None: this function does not apply to this sample; the sample stays in the update
    (total, parts), = score_group(rewards, "Q?", ["abc"], {"solution": "?"}, completion_ids=[(1, 2, 3)])
    assert total == 0.5 and "trl_length_reward" not in parts and not any(k.endswith("/excluded") for k in parts)
    assert parts["trl_length_reward/no_value"] == 1.0  # flagged: no verdict from it (test below)


def test_an_async_trl_reward_and_one_of_the_wrong_length() -> None:
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:trl_async_reward"},
                             {"fn": "tests.test_interop_rewards:trl_wrong_length"}])
    out = score_group(rewards, "Q", ["abc", "xyz"], {})
    assert [p["trl_async_reward"] for _, p in out] == [1.0, 0.0]
    assert all(p["trl_wrong_length/error"] == 1.0 for _, p in out)  # one value per completion, or an error


def test_trls_own_reward_functions_on_a_conversational_prompt() -> None:
    """trl.rewards' accuracy_reward and think_format_reward (the installed TRL), as GRPOTrainer
    calls them for a dataset whose prompt is chat messages."""
    rewards = build_rewards([{"fn": "trl.rewards:accuracy_reward"}, {"fn": "trl.rewards:think_format_reward"}])
    messages = [{"role": "user", "content": "What is 1/3 of 1?"}]
    example = {"solution": r"\frac{1}{3}", PROMPT_MESSAGES: messages}
    completions = [r"<think>easy</think>The answer is $\boxed{\frac{1}{3}}$.", r"The answer is $\boxed{\frac{1}{2}}$."]
    out = score_group(rewards, "What is 1/3 of 1?", completions, example)
    assert [(p["accuracy_reward"], p["think_format_reward"]) for _, p in out] == [(1.0, 1.0), (0.0, 0.0)]
    # a gold answer math-verify cannot parse: TRL's accuracy_reward says None ("skip"): no value here
    out = score_group(rewards, "Q", [r"$\boxed{1}$"], {"solution": "not math", PROMPT_MESSAGES: messages})
    assert "accuracy_reward" not in out[0][1] and "think_format_reward" in out[0][1]


def test_a_verl_compute_score_gets_its_arguments_from_verls_layout(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "system", "content": "Think step by step."},
                        {"role": "user", "content": "Tom has 3 apples and buys 4. How many? End with #### <n>."}],
             "reward_model": {"style": "rule", "ground_truth": "7"},
             "extra_info": {"split": "train", "index": 0}}]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    (ex,) = parquet_examples(path, format="verl")
    assert ex.answer == "7" and ex.fields["data_source"] == "openai/gsm8k"
    assert ex.prompt.startswith("Tom has 3 apples") and ex.fields[PROMPT_MESSAGES][0]["role"] == "system"
    tok = make_tiny_tokenizer()
    expected = tok.apply_chat_template(rows[0]["prompt"], add_generation_prompt=True, tokenize=False)
    assert tok.decode(render_example(tok, ex)) == expected  # the system turn included, nothing appended
    CALLS.clear()
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:gsm8k_style_score"},
                             {"fn": "tests.test_interop_rewards:verl_without_extra_info"}])
    out = score_group(rewards, ex.prompt, ["3 + 4 = 7\n#### 7", "#### 8"], ex.fields)
    assert [p["gsm8k_style_score"] for _, p in out] == [1.0, 0.0]  # a dict's "score"
    # its other numbers logged beside it, as verl logs them (the text "pred" is not a number)
    assert [p["gsm8k_style_score/format_ok"] for _, p in out] == [1.0, 1.0]
    assert out[0][1]["gsm8k_style_score/excluded_"] == 2.5 and "gsm8k_style_score/excluded" not in out[0][1]
    assert not any(k.endswith("pred") for _, p in out for k in p) and [t for t, _ in out] == [2.0, 0.0]
    assert [p["verl_without_extra_info"] for _, p in out] == [1.0, 0.0]
    assert CALLS[0] == {"data_source": "openai/gsm8k", "ground_truth": "7", "extra_info": {"split": "train", "index": 0}}


def test_verl_reward_kwargs_are_passed_on_every_call() -> None:
    """verl calls `compute_score(..., **reward_kwargs)`; rlvr takes them as the reward's kwargs."""
    fields = {"data_source": "openai/gsm8k", "reward_model": {"ground_truth": "7"}}
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:verl_scaled_score", "style": "verl",
                              "kwargs": {"correct": 2.0, "format_score": 0.1}}])
    out = score_group(rewards, "Q", ["#### 7", "#### 8", "7"], fields)
    assert [p["verl_scaled_score"] for _, p in out] == [2.0, 0.1, 0.0]
    CALLS.clear()
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:verl_with_var_kwargs", "kwargs": {"mode": "strict"}}])
    score_group(rewards, "Q", ["x"], fields)
    assert CALLS == [{"extra_info": None, "mode": "strict"}]  # **kwargs takes extra_info and the reward_kwargs
    with pytest.raises(ValueError, match="reward 'verl_scaled_score'.*'formatscore'.*not parameters"):
        build_rewards([{"fn": "tests.test_interop_rewards:verl_scaled_score", "kwargs": {"formatscore": 0.1}}])
    with pytest.raises(ValueError, match="one response at a time"):
        build_rewards([{"fn": "tests.test_interop_rewards:verl_scaled_score", "group": True}])
    with pytest.raises(ValueError, match="'ground_truth'.*would replace what verl passes"):
        build_rewards([{"fn": "tests.test_interop_rewards:verl_with_var_kwargs", "kwargs": {"ground_truth": "8"}}])


def test_trl_layouts_from_jsonl_and_a_datasets_directory(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": "What is 2 + 2?", "solution": "4"},
            {"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "What is 3 + 3?"}],
             "solution": "6"}]
    path = tmp_path / "trl.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    plain, chat = jsonl_examples(path, format="trl")
    assert plain.prompt == "What is 2 + 2?" and PROMPT_MESSAGES not in plain.fields and plain.answer is None
    assert chat.prompt == "What is 3 + 3?" and chat.fields["solution"] == "6"
    tok = make_tiny_tokenizer()
    assert tok.decode(render_example(tok, chat)) == tok.apply_chat_template(rows[1]["prompt"], add_generation_prompt=True,
                                                                            tokenize=False)
    disk = tmp_path / "ds"
    datasets.Dataset.from_list([rows[1]]).save_to_disk(str(disk))
    from rlvr.data.tasks import hf_examples

    (from_disk,) = hf_examples(str(disk), format="trl")
    assert from_disk.fields[PROMPT_MESSAGES] == chat.fields[PROMPT_MESSAGES]
    with pytest.raises(ValueError, match="must be a string.*task.params.format"):
        jsonl_examples(path, answer_column="solution")  # the rlvr layout: a list prompt needs the format named
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": [{"role": "system", "content": "x"}]}))
    with pytest.raises(ValueError, match="bad.jsonl:1.*no user message"):
        jsonl_examples(bad, format="trl")
    bad.write_text(json.dumps({"question": "x"}))
    with pytest.raises(ValueError, match="bad.jsonl:1: no 'prompt' column"):
        jsonl_examples(bad, format="verl")


def test_training_on_trl_data_with_trls_reward(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.config import ConfigError, load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": [{"role": "user", "content": f"Say {c}."}], "letter": c})
                              for c in "abcdefghijklmnop"))
    base = [x for x in overrides(tiny_dir, tmp_path, "trl", train__steps=2) if not x.startswith(("task.params", "rewards"))]
    cfg = [*base, 'task.source="jsonl"', f'task.path="{data}"', 'task.params={format = "trl"}', "task.eval_size=2",
           'rewards=[{fn = "tests.test_interop_rewards:trl_async_reward"}, {fn = "tests.test_interop_rewards:letter_reward"}]']
    train(load_config(None, cfg), quiet=True)
    rows = read_metrics(tmp_path / "trl")
    assert len(rows) == 2 and "rewards/trl_async_reward" in rows[0] and "rewards/letter_reward" in rows[0]
    with pytest.raises((ConfigError, ValueError), match="task.params.format = 'trl' needs \\[\\[rewards\\]\\]"):
        load_config(None, [x for x in cfg if not x.startswith("rewards")])


def letter_reward(completions: list[list[dict[str, str]]], letter: list[str], **kwargs: Any) -> list[float]:
    """TRL conversational: each completion is [{"role": "assistant", "content": ...}]."""
    return [float(want in c[0]["content"]) for c, want in zip(completions, letter)]


def trl_answer_in(completions: list[str], answer: list[Any], **_: Any) -> list[float]:
    return [1.0 if c.strip() in a else 0.0 for c, a in zip(completions, answer)]


def trl_ids_only(completion_ids: list[list[int]], **_: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def trl_numpy(completions: list[str], **_: Any) -> Any:
    import numpy as np

    return np.array([float(len(c)) for c in completions])


def verl_tensor(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
    import torch

    return torch.tensor(float(solution_str == ground_truth))


def test_a_trl_reward_gets_the_answer_column_as_the_dataset_holds_it(tmp_path: Path) -> None:
    """Found by a red-team review (session 19): the "answer" column reached TRL rewards as text,
    so `c in ["4", "40"]` ran on "['4', '40']" and paid "0", "," and "["."""
    path = tmp_path / "trl.jsonl"
    path.write_text(json.dumps({"prompt": "2 + 2?", "answer": ["4", "40"]}) + "\n" + json.dumps({"prompt": "n?", "answer": 42}))
    listed, number = jsonl_examples(path, format="trl")
    assert listed.fields["answer"] == ["4", "40"] and number.fields["answer"] == 42 and number.answer == "42"
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:trl_answer_in"}])
    out = score_group(rewards, listed.prompt, ["0", ",", "[", "4", "40"], listed.fields)
    assert [total for total, _ in out] == [0.0, 0.0, 0.0, 1.0, 1.0]
    (plain,) = jsonl_examples(path.parent / "trl.jsonl", format="rlvr")[:1]
    assert plain.fields["answer"] == "['4', '40']"  # rlvr's own layout: the answer is text


def test_trl_rewards_named_by_ids_or_prompts_and_arrays_or_tensors_returned() -> None:
    """TRL and verl accept these; rlvr misread the style or refused the values (session 19)."""
    assert detect_style(trl_ids_only) == "trl"
    rewards = build_rewards([{"fn": "tests.test_interop_rewards:trl_ids_only"},
                             {"fn": "tests.test_interop_rewards:trl_numpy"}])
    out = score_group(rewards, "Q", ["ab", "abc"], {}, completion_ids=[(1, 2), (1, 2, 3)])
    assert [p["trl_ids_only"] for _, p in out] == [2.0, 3.0] and [p["trl_numpy"] for _, p in out] == [2.0, 3.0]
    verl = build_rewards([{"fn": "tests.test_interop_rewards:verl_tensor"}])
    out = score_group(verl, "Q", ["7", "8"], {"data_source": "x", "reward_model": {"ground_truth": "7"}})
    assert [p["verl_tensor"] for _, p in out] == [1.0, 0.0] and not any("error" in k for _, p in out for k in p)


def trl_correct_or_none(completions: list[str], answer: list[str], **_: Any) -> list[float | None]:
    """TRL's accuracy_reward's shape: 1 or 0, None where the gold cannot be read ("?")."""
    return [None if a == "?" else float(c.strip() == a) for c, a in zip(completions, answer)]


def test_a_trl_none_from_the_correctness_reward_is_no_verdict_in_accuracy() -> None:
    """The README's accuracy is over the samples the first reward judged: of 8 samples, one the
    TRL reward left without a value (None) and one right, accuracy is 1/7, not 1/8; the sample
    stays in the update (TRL's None is no contribution, not an exclusion)."""
    from rlvr.train.rollouts import group_metrics
    from rlvr.types import Completion, Group, Sample

    rewards = build_rewards([{"fn": "tests.test_interop_rewards:trl_correct_or_none"},
                             {"fn": "tests.test_interop_rewards:rlvr_reward", "weight": 0.0}])
    samples = []
    for k in range(8):
        answer = "?" if k == 0 else "4"
        (total, parts), = score_group(rewards, "2+2?", ["4" if k == 1 else "5"], {"answer": answer})
        samples.append(Sample((1,), Completion((2,), (0.0,), "stop", "x"), total, parts, 0))
    m = group_metrics([Group("2+2?", tuple(samples), {})], rewards[0].name)
    assert m["accuracy"] == pytest.approx(1 / 7)
    assert m["no_verdict_fraction"] == pytest.approx(1 / 8)
    assert m["rewards/trl_correct_or_none/no_value"] == pytest.approx(1 / 8)
    assert m["excluded_fraction"] == 0.0  # still trained on
