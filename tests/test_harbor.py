"""Harbor tasks (env.name = "harbor") in rlvr's sandbox: task directories laid out as Harbor lays
them out (rlvr/configs/harbor_sums.py writes them; harbor 0.25.0's own `harbor lint` and task
model accept them, docs/LOG.md session 30), each task's reference solution scoring 1 through
rlvr's runner and doing nothing 0, the verifier's files out of the policy's reach, and a
verifier without a verdict never scored as the policy's failure."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from rlvr import sandbox
from rlvr.agents import Limits
from rlvr.agents.envs import env_factory
from rlvr.agents.harbor import check, examples, load_task
from rlvr.agents.runner import ChatDelta, episode_groups
from rlvr.configs.harbor_sums import write_task
from rlvr.types import SamplingParams
from tests.test_env_conformance import PolicyEngine
from tests.tiny import EOS_ID

pytestmark = pytest.mark.dtype_independent  # scripted policies: no model


@pytest.fixture(autouse=True)
def needs_bwrap() -> None:
    if sandbox.bwrap_path() is None:
        pytest.skip("bubblewrap is not installed")


def tasks(tmp_path: Path, count: int = 2, from_file: bool = False) -> Path:
    folder = tmp_path / ("from-file" if from_file else "tasks")
    for k in range(count):
        write_task(folder, k, from_file)
    return folder


def play(folder: Path, policy: Any, n: int = 1, max_turns: int = 4) -> list[Any]:
    engine = PolicyEngine(policy)
    exs = examples({"tasks": str(folder)}, 0)
    return episode_groups(engine, engine.tok, env_factory("harbor"), exs, list(range(len(exs))), n, [],
                          SamplingParams(max_new_tokens=200), Limits(max_turns=max_turns, max_turn_tokens=200),
                          ChatDelta(engine.tok), [EOS_ID], kwargs={"tasks": str(folder)})


def oracle(context: str) -> str:
    """Harbor's oracle agent: the task's solution/solve.sh, then done."""
    if "(no output)" in context:
        return "Done."
    task = next(t for t in _TASKS if load_task(t).instruction in context)
    return "```bash\n" + (task / "solution" / "solve.sh").read_text() + "```"


_TASKS: list[Path] = []


@pytest.mark.parametrize("from_file", [False, True], ids=["instruction", "copied-file"])
def test_each_tasks_reference_solution_scores_1_and_doing_nothing_0(tmp_path: Path, from_file: bool) -> None:
    folder = tasks(tmp_path, 3, from_file)
    _TASKS[:] = sorted(folder.iterdir())
    solved = play(folder, oracle, n=2)
    assert [g.metadata["endings"] for g in solved] == [["done", "done"]] * 3
    assert [s.reward for g in solved for s in g.samples] == [1.0] * 6
    assert all(m["verifier/answer_file"] == 1.0 for g in solved for m in g.metadata["env_metrics"])
    idle = play(folder, lambda c: "I am done.")
    assert [s.reward for g in idle for s in g.samples] == [0.0] * 3
    assert all(m["verifier/answer_file"] == 0.0 for g in idle for m in g.metadata["env_metrics"])
    wrong = play(folder, lambda c: "Done." if "(no output)" in c else "```bash\necho 99 > /app/answer.txt\n```")
    assert [s.reward for g in wrong for s in g.samples] == [0.1] * 3  # the example tasks' format credit
    # the examples' `solution` field, as a warm start's template renders it, is a demonstration that solves
    solutions = {ex.prompt: ex.fields["solution"] for ex in examples({"tasks": str(folder)}, 0)}
    assert all(not text.startswith("#!") and "/app/answer.txt" in text for text in solutions.values())
    demo = play(folder, lambda c: "Done." if "(no output)" in c else
                "```bash\n" + next(v for k, v in solutions.items() if k in c) + "\n```")
    assert [s.reward for g in demo for s in g.samples] == [1.0] * 3


def test_the_files_persist_between_commands_and_the_policy_sees_their_output(tmp_path: Path) -> None:
    folder = tasks(tmp_path, 1, from_file=True)
    task = load_task(next(folder.iterdir()))
    total = sum(int(x) for x in (task.path / "environment" / "numbers.txt").read_text().split())

    def reads_then_writes(context: str) -> str:
        turn = context.count("<|im_start|>assistant") - 1
        seen = context.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]  # the last observation
        if turn == 0:
            return "```bash\ncat numbers.txt\npwd\n```"
        if turn == 1:
            a, b, where = seen.split()
            return f"```bash\necho {int(a) + int(b)} > answer.txt\nls {where}\n```"
        return "Finished."

    (g,) = play(folder, reads_then_writes)
    assert g.samples[0].reward == 1.0, g.metadata["texts"]
    assert f"echo {total} > answer.txt" in g.metadata["texts"][0] and "answer.txt\nnumbers.txt" in g.metadata["texts"][0]


def test_the_policy_cannot_reach_the_verifiers_files(tmp_path: Path) -> None:
    """Writing a reward where the verifier leaves it, or rewriting the tests, before saying done:
    /logs and /tests are not there during the policy's turns, and the root is read-only."""
    folder = tasks(tmp_path, 1)
    hacks = ["mkdir -p /logs/verifier && echo 1 > /logs/verifier/reward.txt",
             "echo 'echo 1 > /logs/verifier/reward.txt' > /tests/test.sh",
             "echo 1 > /tmp/answer.txt; ln -s /tmp/answer.txt /app/answer.txt"]

    def hacker(context: str) -> str:
        done = context.count("(exit status") + context.count("(no output)")
        return f"```bash\n{hacks[done]}\n```" if done < len(hacks) else "Done."

    (g,) = play(folder, hacker, max_turns=5)
    assert g.metadata["endings"] == ["done"] and g.samples[0].reward == 0.0
    assert "Read-only file system" in g.metadata["texts"][0]


def test_a_verifier_without_a_verdict_is_infra_not_zero(tmp_path: Path) -> None:
    folder = tasks(tmp_path, 2)
    first, second = sorted(folder.iterdir())
    (first / "tests" / "test.sh").write_text("#!/bin/bash\necho 'forgot the reward'\n")
    (second / "tests" / "test.sh").write_text("#!/bin/bash\necho 'not a number' > /logs/verifier/reward.txt\n")
    groups = play(folder, lambda c: "Done.")
    assert [g.metadata["endings"] for g in groups] == [["infra"], ["infra"]]
    assert all(s.excluded for g in groups for s in g.samples)


def test_tasks_that_need_a_container_are_refused_before_the_run(tmp_path: Path) -> None:
    folder = tasks(tmp_path, 2)
    first, second = sorted(folder.iterdir())
    with (first / "environment" / "Dockerfile").open("a") as f:
        f.write("RUN apt-get update && apt-get install -y jq\n")
    env = type("Env", (), {"kwargs": {"tasks": str(folder)}})()
    with pytest.raises(ValueError, match="1 of 2 Harbor tasks need a container.*RUN apt-get"):
        check(env)
    (first / "environment" / "Dockerfile").write_text("FROM python:3.12-slim\nWORKDIR /app\n")
    (second / "task.toml").write_text((second / "task.toml").read_text().replace(
        "[environment]\n", '[environment]\ndocker_image = "ghcr.io/org/image:1"\n'))
    with pytest.raises(ValueError, match="docker_image"):
        check(env)
    with pytest.raises(ValueError, match="needs env.kwargs.tasks"):
        examples({}, 0)


def test_training_on_harbor_tasks(tiny_dir: Path, tmp_path: Path) -> None:
    """2 steps on the tiny model (which never writes a command: every episode is verified at once)."""
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    folder = tasks(tmp_path, 6)
    cfg = load_config(None, [*overrides(tiny_dir, tmp_path, "harbor", train__steps=2), 'env.name="harbor"',
                             f'env.kwargs={{tasks = "{folder}"}}', "env.max_turns=2", "task.eval_size=2",
                             "train.prompts_per_step=2"])
    assert cfg.task.source == "env"
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "harbor")
    assert len(rows) == 2 and rows[-1]["env/ending/done"] > 0  # the verifier ran and gave its verdict
    assert "env/verifier/answer_file" in rows[-1]


TWO_TURNS = "```bash\\n{solution}\\n```{next_turn}Done."
"""The tasks' solve.sh, then the turn that ends the episode (an expert.template, TOML-escaped)."""
ONE_TURN = "```bash\\n{solution}\\n```"


def warm_start_config(tiny_dir: Path, tmp_path: Path, name: str, template: str, max_turns: int,
                      when: str = 'when = "start"') -> Any:
    """2 steps on 6 tasks with a warm start on their solutions after the first."""
    from rlvr.config import load_config
    from tests.test_train import overrides

    folder = tasks(tmp_path / f"{name}-tasks", 6)
    return load_config(None, [*overrides(tiny_dir, tmp_path, name, train__steps=2), 'env.name="harbor"',
                              f'env.kwargs={{tasks = "{folder}"}}', f"env.max_turns={max_turns}", "task.eval_size=2",
                              "train.prompts_per_step=2", 'expert.mode="warm_start"',
                              f'expert.template="{template}"', f"expert.kwargs={{{when}}}"])


def test_a_warm_start_on_the_tasks_reference_solutions(tiny_dir: Path, tmp_path: Path) -> None:
    """expert.mode = "warm_start" with the tasks' solve.sh as demonstrations of whole episodes (the
    command, then "Done."): played through the environment, verified, fine-tuned on, then RL."""
    from rlvr.train.loop import train
    from tests.test_train import read_metrics

    train(warm_start_config(tiny_dir, tmp_path, "warm", TWO_TURNS, 3, 'when = "start", epochs = 2, batch = 2'),
          quiet=True)
    rows = read_metrics(tmp_path / "warm")
    (warm,) = [r for r in rows if "expert/warm_start_steps" in r]
    assert warm["expert/warm_start_steps"] == 4  # 4 training tasks, batches of 2, 2 epochs
    assert warm["expert/warm_start_demo_reward"] == 1.0  # every demonstration, played, passed its verifier
    assert warm["expert/warm_start_nll_last"] < warm["expert/warm_start_nll_first"]


def test_a_demonstration_that_does_not_end_its_episode_is_refused(tiny_dir: Path, tmp_path: Path) -> None:
    from rlvr.train.loop import train

    with pytest.raises(ValueError, match="ran out of turns before its episode ended"):
        train(warm_start_config(tiny_dir, tmp_path, "short", ONE_TURN, 3), quiet=True)
    with pytest.raises(ValueError, match="turns left after its episode ended .max_turns."):
        train(warm_start_config(tiny_dir, tmp_path, "cut", TWO_TURNS, 1), quiet=True)  # max_turns 1 cuts it
    with pytest.raises(ValueError, match="did not finish its episode: it ended 'max_turns'"):
        # its one turn used, but the limit, not the policy, ended the episode
        train(warm_start_config(tiny_dir, tmp_path, "one", ONE_TURN, 1), quiet=True)


def test_a_warm_start_is_refused_where_an_agent_writes_the_prompts() -> None:
    from rlvr.config import load_config
    from rlvr.train.methods.expert import check

    cfg = load_config(None, ['env.name="openai_agent"', 'env.kwargs={entry = "x:y"}', 'expert.mode="warm_start"'])
    with pytest.raises(ValueError, match="runs an agent that writes its own prompts"):
        check(cfg)
    with pytest.raises(ValueError, match="does not combine with multi-turn episodes"):
        check(load_config(None, ['env.name="harbor"', 'env.kwargs={tasks = "t"}', 'expert.mode="relift"']))
