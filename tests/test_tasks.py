"""Prompt sources (reasoning-gym, JSONL) and chat rendering."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rlvr.data import (
    Example,
    jsonl_examples,
    list_tasks,
    reasoning_gym_examples,
    render_prompt,
)
from rlvr.rewards import reasoning_gym_reward

CHAIN_SUM = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}


def test_list_tasks_is_sorted_and_has_chain_sum() -> None:
    tasks = list_tasks()
    assert tasks == sorted(tasks) and "chain_sum" in tasks and len(tasks) > 50


def test_reasoning_gym_examples_are_deterministic_and_scoreable() -> None:
    examples = reasoning_gym_examples(
        "chain_sum", size=4, seed=1, params=CHAIN_SUM, instruction="Answer in <answer></answer>."
    )
    again = reasoning_gym_examples("chain_sum", size=4, seed=1, params=CHAIN_SUM)
    assert len(examples) == 4
    assert [e.answer for e in examples] == [e.answer for e in again]
    first = examples[0]
    assert first.id == "chain_sum/1/0"
    assert first.prompt == first.fields["entry"]["question"] + "\n\nAnswer in <answer></answer>."
    assert first.fields["task"] == "chain_sum" and first.fields["answer"] == first.answer
    # The fields are exactly what the reasoning_gym reward needs.
    completion = f"<answer>{first.answer}</answer>"
    assert reasoning_gym_reward(first.prompt, completion, **first.fields) == 1.0


def test_different_seeds_draw_different_reasoning_gym_data() -> None:
    """reasoning-gym seeds item i with seed + i: without rlvr's stride, seed 1's items would be
    seed 0's shifted by one (49 of 50 shared here). Seed 0 stays reasoning-gym's own seed 0."""
    import reasoning_gym

    wide = {"min_terms": 2, "max_terms": 2, "min_digits": 2, "max_digits": 2}
    zero = [e.prompt for e in reasoning_gym_examples("chain_sum", size=50, seed=0, params=wide)]
    one = [e.prompt for e in reasoning_gym_examples("chain_sum", size=50, seed=1, params=wide)]
    assert len(set(zero) & set(one)) <= 2  # 2-digit sums: ~16,000 prompts, so chance overlaps only
    plain = reasoning_gym.create_dataset("chain_sum", size=50, seed=0, **wide)
    assert zero == [plain[i]["question"] for i in range(50)]


def test_reasoning_gym_unknown_task_suggests_nearest() -> None:
    with pytest.raises(ValueError, match="'chain_sum'.*rlvr tasks"):
        reasoning_gym_examples("chain_summ", size=1, seed=0, params={})


def test_reasoning_gym_bad_params_name_the_task() -> None:
    with pytest.raises(ValueError, match="'chain_sum'.*max_term.*Valid params: .*max_terms"):
        reasoning_gym_examples("chain_sum", size=1, seed=0, params={"max_term": 3})
    with pytest.raises(ValueError, match="'chain_sum'.*max_terms must be >= min_terms"):
        reasoning_gym_examples("chain_sum", size=1, seed=0, params={"min_terms": 5, "max_terms": 2})


def _write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def test_jsonl_examples_keep_every_column(tmp_path: Path) -> None:
    rows: list[dict[str, Any]] = [
        {"prompt": "1+1?", "answer": 2, "level": "easy"},
        {"prompt": "2+2?", "answer": "4", "id": "q2"},
    ]
    lines = [json.dumps(rows[0]), "", json.dumps(rows[1])]  # blank lines are skipped
    path = _write_jsonl(tmp_path / "data.jsonl", lines)
    examples = jsonl_examples(path, instruction="Be brief.")
    assert examples == [
        Example("1+1?\n\nBe brief.", "2", {**rows[0], "answer": "2"}, f"{path}:1"),
        Example("2+2?\n\nBe brief.", "4", {"prompt": "2+2?", "answer": "4", "id": "q2"}, "q2"),
    ]


def test_jsonl_examples_custom_columns(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"question": "q", "solution": 5})])
    (example,) = jsonl_examples(path, prompt_column="question", answer_column="solution")
    assert (example.prompt, example.answer, example.fields["answer"]) == ("q", "5", "5")
    (example,) = jsonl_examples(path, prompt_column="question", answer_column=None)
    assert example.answer is None


def test_jsonl_errors_point_at_the_line(tmp_path: Path) -> None:
    good = json.dumps({"prompt": "p", "answer": "a"})
    bad_json = _write_jsonl(tmp_path / "bad.jsonl", [good, '{"prompt": "p", '])
    with pytest.raises(ValueError, match=rf"bad\.jsonl:2: invalid JSON"):
        jsonl_examples(bad_json)
    other_columns = json.dumps({"question": "p", "answer": "a"})
    missing = _write_jsonl(tmp_path / "missing.jsonl", [good, other_columns])
    expected = r"missing\.jsonl:2: no 'prompt' column; the row has \['answer', 'question'\]"
    with pytest.raises(ValueError, match=expected):
        jsonl_examples(missing)
    no_answer = _write_jsonl(tmp_path / "no_answer.jsonl", [json.dumps({"prompt": "p"})])
    with pytest.raises(ValueError, match=r"no_answer\.jsonl:1: no 'answer' column"):
        jsonl_examples(no_answer)
    not_object = _write_jsonl(tmp_path / "list.jsonl", ["[1, 2]"])
    with pytest.raises(ValueError, match=r"list\.jsonl:1: expected a JSON object"):
        jsonl_examples(not_object)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        jsonl_examples(empty)
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        jsonl_examples(tmp_path / "nope.jsonl")


def test_render_prompt_uses_chat_template(tiny_tokenizer: Any) -> None:
    ids = render_prompt(tiny_tokenizer, "What is 2+2?", system_prompt="Be brief.")
    assert isinstance(ids, list) and all(type(i) is int for i in ids)
    assert tiny_tokenizer.decode(ids) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Special tokens in the template are single tokens, not spelt out byte by byte.
    assert ids[0] == tiny_tokenizer.bos_token_id
    assert ids.count(tiny_tokenizer.eos_token_id) == 2
    no_system = tiny_tokenizer.decode(render_prompt(tiny_tokenizer, "hi"))
    assert no_system == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_render_prompt_without_chat_template_uses_plain_text(tiny_tokenizer: Any) -> None:
    tiny_tokenizer.chat_template = None
    ids = render_prompt(tiny_tokenizer, "What is 2+2?", system_prompt="Be brief.")
    assert tiny_tokenizer.decode(ids) == "Be brief.\n\nWhat is 2+2?"


def test_tiny_tokenizer_round_trips_any_text(tiny_tokenizer: Any) -> None:
    text = "Hello, wörld! {x}^2 = -1.5\t<answer>7</answer>\n"
    ids = tiny_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tiny_tokenizer.decode(ids) == text
    assert len(tiny_tokenizer) <= 512
    assert (tiny_tokenizer.pad_token, tiny_tokenizer.eos_token) == ("<|pad|>", "<|im_end|>")


def test_reasoning_gym_mixture_follows_the_weights_and_scores_each_task_by_its_own() -> None:
    from rlvr.data.tasks import reasoning_gym_mixture
    from rlvr.rewards.builtin import reasoning_gym_reward

    examples = reasoning_gym_mixture([("chain_sum", 2.0, {"min_terms": 2, "max_terms": 2}), ("leg_counting", 1.0, {})],
                                     size=30, seed=0)
    tasks = [ex.fields["task"] for ex in examples]
    assert tasks.count("chain_sum") == 20 and tasks.count("leg_counting") == 10
    assert tasks[:10] != sorted(tasks[:10])  # shuffled together
    for ex in examples[:8]:  # each gold answer is right under its own task's scorer
        assert reasoning_gym_reward(ex.prompt, f"<answer>{ex.answer}</answer>", **ex.fields) == 1.0
    again = reasoning_gym_mixture([("chain_sum", 2.0, {"min_terms": 2, "max_terms": 2}), ("leg_counting", 1.0, {})],
                                  size=30, seed=0)
    assert [ex.prompt for ex in again] == [ex.prompt for ex in examples]


def test_mixture_in_the_config(tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.data import load_examples

    cfg = load_config(None, ['task.mixture=[{name = "chain_sum", weight = 3}, {name = "leg_counting"}]',
                             "task.size=12", "task.eval_size=4"])
    train, held = load_examples(cfg)
    assert len(train) + len(held) == 16 and {ex.fields["task"] for ex in train + held} == {"chain_sum", "leg_counting"}


ROWS = [{"question": f"What is {i} + 1?", "answer": i + 1, "level": i % 3} for i in range(10)]


def test_parquet_and_hf_dataset_sources_read_the_configured_columns(tmp_path: Path) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rlvr.config import load_config
    from rlvr.train.data import load_examples

    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "hf"))
    common = ["task.eval_size=2", 'task.instruction=""']
    for source, extra in (("parquet", [f'task.path="{tmp_path / "d.parquet"}"', 'task.params.prompt_column="question"']),
                          ("hf", [f'task.path="{tmp_path / "hf"}"',
                                  'task.params={prompt_column = "question", split = "test"}'])):
        cfg = load_config(None, [f'task.source="{source}"', *extra, *common])
        assert cfg.rewards[0].fn == "math_verify"
        train, held = load_examples(cfg)
        assert len(train) == 8 and len(held) == 2
        ex = held[0]
        assert ex.prompt == "What is 0 + 1?" and ex.answer == "1" and ex.fields["level"] == 0
    with pytest.raises(ValueError, match="no 'prompt' column"):
        load_examples(load_config(None, ['task.source="parquet"', f'task.path="{tmp_path / "d.parquet"}"']))
    with pytest.raises(Exception, match="task.path is required"):
        load_config(None, ['task.source="hf"'])
    with pytest.raises(ValueError, match="'parquet': unknown keyword 'split'"):  # a file has no splits
        load_examples(load_config(None, ['task.source="parquet"', f'task.path="{tmp_path / "d.parquet"}"',
                                         'task.params.split="test"']))
    with pytest.raises(Exception, match="'task.prompt_column' is now task.params.prompt_column"):
        load_config(None, ['task.prompt_column="question"'])
