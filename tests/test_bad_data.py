"""Bad task data and configuration, from a red-team review (session 20): each either is refused
before training with the file, row and column named, or is read as the user meant; none silently
changes what the model is trained on or how it is scored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlvr.config import ConfigError, load_config
from rlvr.data import jsonl_examples
from rlvr.data.tasks import parquet_examples, reasoning_gym_examples, reasoning_gym_mixture


def _jsonl(tmp_path: Path, rows: list[Any], name: str = "d.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_rows_are_refused_where_they_would_silently_change_the_data(tmp_path: Path) -> None:
    ok = {"prompt": "What is 2+2?", "answer": "4"}
    cases = [
        # a column named like rlvr's own field replaced the prompt the model saw
        ({**ok, "prompt_messages": [{"role": "user", "content": "old text"}]}, "d.jsonl:1: the column 'prompt_messages'"),
        ({**ok, "images": ["a.png"]}, "column 'images'.*image_column"),
        ({"prompt": "   ", "answer": "4"}, "d.jsonl:1: 'prompt' is empty"),
    ]
    for row, message in cases:
        with pytest.raises(ValueError, match=message):
            jsonl_examples(_jsonl(tmp_path, [row]))
    # another column as the gold answer beside the row's own "answer": which one rewards see is ambiguous
    with pytest.raises(ValueError, match="'answer' column beside answer_column 'solution'"):
        jsonl_examples(_jsonl(tmp_path, [{**ok, "solution": "5"}]), answer_column="solution")
    # a null or blank gold answer loads (a HumanEval row's gold is its tests), and a built-in reward
    # that compares with it refuses the rows before training, where it scored every sample 0
    from rlvr.rewards.combine import build_rewards
    from rlvr.train.data import check_answers

    blank = jsonl_examples(_jsonl(tmp_path, [ok, {"prompt": "Q", "answer": None}, {"prompt": "R", "answer": " "}]))
    assert [ex.answer for ex in blank] == ["4", None, None]
    with pytest.raises(ValueError, match=r"reward 'math_verify' compares with the gold answer, and 2 example\(s\)"):
        check_answers(blank, build_rewards([{"fn": "math_verify"}]))
    check_answers(blank, build_rewards([{"fn": "format"}]))  # a reward that reads no answer
    with pytest.raises(ValueError, match=r"d.jsonl:2: id '1' is also the id of .*d.jsonl:1"):
        jsonl_examples(_jsonl(tmp_path, [{**ok, "id": 1}, {**ok, "id": "1"}]))
    (no_id,) = jsonl_examples(_jsonl(tmp_path, [{**ok, "id": None}]))
    assert no_id.id.endswith("d.jsonl:1")  # a null id is no id
    with pytest.raises(ValueError, match="must be a column name"):
        jsonl_examples(_jsonl(tmp_path, [ok]), prompt_column=["prompt"])  # type: ignore[arg-type]


def test_chat_prompts_are_checked_message_by_message(tmp_path: Path) -> None:
    def prompt(*messages: dict[str, Any]) -> dict[str, Any]:
        return {"prompt": list(messages), "answer": "4"}

    user = {"role": "user", "content": "2+2?"}
    cases = [
        (prompt({"role": "usr", "content": "2+2?"}, user), "message 0 has role 'usr'"),
        (prompt(user, {"role": "assistant", "content": "4"}), "the last message is the assistant's"),
        (prompt({**user, "name": "bob"}), r"message 0 has \['name'\]"),
        (prompt({"role": "user", "content": ""}), "message 0 \\(the user's\\) is empty"),
    ]
    for row, message in cases:
        with pytest.raises(ValueError, match=message):
            jsonl_examples(_jsonl(tmp_path, [row]), format="trl")
    assert jsonl_examples(_jsonl(tmp_path, [prompt({"role": "system", "content": "Be terse."}, user)]), format="trl")
    # Arrow gives every message every key any message has, None where absent: not an extra key
    assert jsonl_examples(_jsonl(tmp_path, [prompt({**user, "name": None, "tool_calls": None})]), format="trl")


def test_answers_keep_their_meaning(tmp_path: Path) -> None:
    """An integral float is its integer ("3", not "3.0"; 1e20's 21 digits, not "1e+20"), which
    math_verify scores as the same number; TRL rows keep their own answer column as it is; an
    MBPP row's list of tests stays a list in its column."""
    rows = [{"prompt": "a", "answer": 3.0}, {"prompt": "b", "answer": 1e20}, {"prompt": "c", "answer": 0.5},
            {"prompt": "d", "answer": 7}]
    assert [ex.answer for ex in jsonl_examples(_jsonl(tmp_path, rows))] == ["3", "1" + "0" * 20, "0.5", "7"]
    from rlvr.rewards.builtin import math_verify_reward

    big = jsonl_examples(_jsonl(tmp_path, rows))[1].answer
    assert math_verify_reward("", "<answer>100000000000000000000</answer>", answer=big) == 1.0
    with pytest.raises(ValueError, match="'answer' column beside answer_column 'solution'"):  # which is the gold?
        jsonl_examples(_jsonl(tmp_path, [{"prompt": "p", "answer": 42, "solution": [1, 2]}]), format="trl",
                       answer_column="solution")
    (trl,) = jsonl_examples(_jsonl(tmp_path, [{"prompt": "p", "solution": [1, 2]}]), format="trl", answer_column="solution")
    assert trl.fields["answer"] == "[1, 2]" and trl.fields["solution"] == [1, 2]  # the gold as text, the column as it is
    (trl,) = jsonl_examples(_jsonl(tmp_path, [{"prompt": "p", "answer": [3, 4]}]), format="trl", answer_column=None)
    assert trl.fields["answer"] == [3, 4]
    (mbpp,) = jsonl_examples(_jsonl(tmp_path, [{"prompt": "p", "tests": ["assert f() == 1"]}]), answer_column="tests")
    assert mbpp.fields["tests"] == ["assert f() == 1"]


def test_verl_rows_need_their_ground_truth_and_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = {"data_source": "x", "prompt": [{"role": "user", "content": "2+2?"}], "reward_model": {"style": "rule"}}
    path = tmp_path / "v.parquet"
    pq.write_table(pa.Table.from_pylist([row]), path)
    with pytest.raises(ValueError, match=r"v.parquet:row 0: no reward_model.ground_truth"):
        parquet_examples(path, format="verl")
    for gold, answer in (({"style": "model", "ground_truth": ""}, ""), ({"style": "rule", "ground_truth": 7.0}, "7")):
        pq.write_table(pa.Table.from_pylist([{**row, "reward_model": gold}]), path)
        assert parquet_examples(path, format="verl")[0].answer == answer
    pq.write_table(pa.Table.from_pylist([{**row, "answer": "5"}]), path)  # verl's fallback: a top-level answer
    assert parquet_examples(path, format="verl")[0].answer == "5"
    # verl's and TRL's vision layouts: one user message and an "images" column
    vision = {"prompt": [{"role": "user", "content": "<image>How many?"}], "images": ["a.png"],
              "reward_model": {"ground_truth": "3"}}
    pq.write_table(pa.Table.from_pylist([vision]), path)
    assert parquet_examples(path, format="verl")[0].fields["images"] == ["a.png"]
    with pytest.raises(ValueError, match="leave prompt_column and answer_column unset"):
        parquet_examples(path, format="verl", prompt_column="question")


def test_held_out_prompts_differ_by_their_whole_conversation(tmp_path: Path) -> None:
    from rlvr.train.data import load_examples

    rows = [{"prompt": [{"role": "system", "content": f"Reply in {lang}."}, {"role": "user", "content": "Capital of Italy?"}],
             "answer": "Rome"} for lang in ("French", "German", "Italian")]
    cfg = load_config(None, ['task.source="jsonl"', f'task.path="{_jsonl(tmp_path, rows)}"',
                             'task.params={format = "trl"}', "task.eval_size=1",
                             'rewards=[{fn = "tests.test_interop_rewards:trl_async_reward"}]'])
    train, held = load_examples(cfg)
    assert len(held) == 1 and len(train) == 2  # three prompts, not one asked thrice


def test_templates_refuse_chat_prompts(tmp_path: Path) -> None:
    from rlvr.train.data import TaskData, with_variants
    from rlvr.types import SamplingParams
    from tests.tiny import make_tiny_tokenizer

    rows = [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}], "answer": "1"}]
    examples = jsonl_examples(_jsonl(tmp_path, rows), format="trl")
    cfg = load_config(None, ['sampler.templates=["Think. {prompt}"]'])
    task = TaskData(examples, [[1]], [], [], [], SamplingParams())
    with pytest.raises(ValueError, match="would drop the rest of a conversation"):
        with_variants(cfg, make_tiny_tokenizer(), task, 2048)
    # one user message (verl's gsm8k): nothing to drop
    single = jsonl_examples(_jsonl(tmp_path, [{"prompt": [{"role": "user", "content": "Q"}], "answer": "1"}]), format="trl")
    assert with_variants(cfg, make_tiny_tokenizer(), TaskData(single, [[1]], [], [], [], SamplingParams()), 2048).variants


def test_config_refuses_what_it_would_ignore_or_misread(tmp_path: Path) -> None:
    data = _jsonl(tmp_path, [{"prompt": "Q", "answer": "1"}])
    cases = [
        ([f'task.path="{data}"'], "task.path is read only when task.source is one of"),
        (['task.mixture=[{name = "leg_counting"}]', 'task.name="basic_arithmetic"'], "task.mixture replaces task.name"),
        (['task.mixture=[{name = "leg_counting"}]', 'task.source="jsonl"', f'task.path="{data}"'],
         "task.mixture mixes reasoning-gym tasks"),
        (["train.steps=true"], "train.steps"),
        (['train.prompts_per_step="4"'], "train.prompts_per_step"),
        (["sampling.temperature=inf"], "sampling.temperature"),
        (["train.lr=nan"], "train.lr"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            load_config(None, overrides)
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0  # an integer where a float goes is still a number
    assert load_config(None, ["train.betas=[0.9, 0.95]"]).train.betas == (0.9, 0.95)  # TOML's array for a tuple


def test_every_reasoning_gym_tasks_own_defaults_pass_the_type_check() -> None:
    """The check must not refuse what reasoning-gym itself sets (rearc annotates diff_ub int and
    sets 0.2)."""
    import dataclasses

    from rlvr.data.tasks import DATASETS, _check_param_types

    for task, (_, config) in DATASETS.items():
        defaults = {f.name: f.default for f in dataclasses.fields(config)
                    if f.default is not dataclasses.MISSING and f.name not in ("size", "seed")}
        _check_param_types(task, defaults)


def test_reasoning_gym_params_and_mixtures_are_checked() -> None:
    with pytest.raises(ValueError, match="param allow_negation = 'no' must be bool"):
        reasoning_gym_examples("chain_sum", size=2, seed=0, params={"allow_negation": "no"})
    with pytest.raises(ValueError, match="param max_digits = True must be int"):
        reasoning_gym_examples("chain_sum", size=2, seed=0, params={"max_digits": True})
    with pytest.raises(ValueError, match="gives basic_arithmetic none"):
        reasoning_gym_mixture([("chain_sum", 1, {}), ("leg_counting", 1, {}), ("basic_arithmetic", 1, {})],
                              size=2, seed=0)


def test_datasets_folder_splits_are_named(tmp_path: Path) -> None:
    import datasets

    from rlvr.data.tasks import hf_examples

    rows = [{"prompt": "Q", "answer": "1"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(ValueError, match="single dataset, without splits"):
        hf_examples(str(tmp_path / "single"), split="test")
    with pytest.raises(ValueError, match=r"no split 'test' \(task.params.split\); it has \['train'\]"):
        hf_examples(str(tmp_path / "dict"), split="test")
    assert len(hf_examples(str(tmp_path / "single"))) == 1


def test_filtered_trl_rows_read_back_as_they_were(tmp_path: Path) -> None:
    """`rlvr filter` writes what its loader reads back to the same example: a conversation stays
    one, and a TRL answer keeps its type."""
    from rlvr.data.filter import Rated, write_filtered

    rows = [{"prompt": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Capital of Italy?"}],
             "answer": ["Rome", "Roma"]}]
    (ex,) = jsonl_examples(_jsonl(tmp_path, rows), format="trl")
    out = tmp_path / "kept.jsonl"
    assert write_filtered([Rated(ex, 0.5)], out, low=0.0, high=1.0) == 1
    (back,) = jsonl_examples(out, format="trl")
    assert back.fields["prompt_messages"] == ex.fields["prompt_messages"] and back.fields["answer"] == ["Rome", "Roma"]
    # another answer column, and a null answer (a HumanEval row): each reads back with the params it was read with
    (solution, humaneval) = jsonl_examples(_jsonl(tmp_path, [{"prompt": "Q", "solution": "4"}, {"prompt": "R", "solution": None}]),
                                           answer_column="solution")
    assert write_filtered([Rated(solution, 0.5), Rated(humaneval, 0.5)], out, low=0.0, high=1.0) == 2
    assert [ex.answer for ex in jsonl_examples(out, answer_column="solution")] == ["4", None]


def test_chat_files_read_like_task_files(tmp_path: Path) -> None:
    """The SFT/DPO readers: a byte-order mark is allowed, a U+2028 inside a string is text (not a
    line break), and preference scores must be numbers (named by file and line)."""
    from rlvr.data.chat import ChatDataError, preference_pair, read_rows
    from tests.tiny import make_tiny_tokenizer

    path = tmp_path / "c.jsonl"
    path.write_bytes("\ufeff".encode() + json.dumps({"prompt": "a\u2028b", "completion": "c"}, ensure_ascii=False).encode())
    (row,) = read_rows(path)
    assert row[1]["prompt"] == "a\u2028b"
    pair = {"prompt": "Q", "chosen": "a", "rejected": "b", "score_chosen": "high", "score_rejected": 1}
    with pytest.raises(ChatDataError, match="c.jsonl:3: \"score_chosen\" and \"score_rejected\" must be finite numbers"):
        preference_pair(make_tiny_tokenizer(), pair, "c.jsonl:3", eos_token_ids=[2])


def test_a_missing_relative_prompt_file_says_it_was_read_from_the_current_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bundled configs name their data relative to the repository's root: run from elsewhere,
    the error said only "not found"."""
    from rlvr.data.tasks import jsonl_examples

    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"task.path, read from the current directory {tmp_path}"):
        jsonl_examples("configs/data/word_problems.jsonl")
