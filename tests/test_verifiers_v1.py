"""verifiers v1 environments (a Taskset with its Tasks' rewards, verifiers' null harness, an MCP
toolset, a multi-turn Env), written as their authors write them (tests/vf_v1, installed packages
found by id) and trained by rlvr unchanged through its OpenAI-compatible server."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("verifiers.v1")

from rlvr.agents.verifiers_env import environment_examples, verifiers_episodes  # noqa: E402
from rlvr.types import SamplingParams  # noqa: E402
from rlvr.agents.runner import FAILED  # noqa: E402
from tests.test_env_conformance import PolicyEngine, check_faithful  # noqa: E402

pytestmark = pytest.mark.dtype_independent  # scripted policies: no model

TASKSETS = str(Path(__file__).with_name("vf_v1"))
EXAMPLE = str(Path(__file__).parents[1] / "examples" / "verifiers_sums")
"""The packaged example's taskset, whose Task (the sum and its reward) tests/vf_v1 build on."""


def install_tasksets(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/vf_v1 and the example on the path, as if their tasksets were installed (tool servers
    are processes: the variable too)."""
    for folder in (EXAMPLE, TASKSETS):
        monkeypatch.syspath_prepend(folder)
    inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([TASKSETS, EXAMPLE, *inherited]))


@pytest.fixture(autouse=True)
def tasksets_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    install_tasksets(monkeypatch)


class Env:
    """The env config section, as episode builders read it."""

    def __init__(self, taskset: str | dict[str, Any], max_turns: int = 4, **block: Any) -> None:
        taskset = {"id": taskset} if isinstance(taskset, str) else taskset
        self.kwargs = {"v1": {"taskset": taskset, "agent": {"harness": {"id": "null"}}, **block},
                       "timeout": 60}
        self.max_turns, self.max_total_tokens, self.max_context = max_turns, 512, 4096
        self.mask: list[str] = []


def _run(env: Env, engine: PolicyEngine, indices: list[int], n: int = 2) -> list[Any]:
    examples = environment_examples(env.kwargs)
    return verifiers_episodes(env, engine.tok, [], SamplingParams(max_new_tokens=96))(engine, examples, indices, n)


def _sum(context: str) -> str:
    """The right answer to the last "What is a + b?" shown."""
    a, b = context.rsplit("What is ", 1)[1].split("?")[0].split(" + ")
    return str(int(a) + int(b))


def test_the_tasksets_tasks_become_the_prompts() -> None:
    examples = environment_examples(Env("vf-sums").kwargs)
    assert len(examples) == 8  # SumsConfig.size
    assert examples[1].prompt == "What is 1 + 4? Answer with just the number." and examples[1].answer == "5"
    sized = environment_examples(Env({"id": "vf-sums", "size": 3}).kwargs)
    assert len(sized) == 3  # the taskset's own config, from the block


def test_a_taskset_scored_by_its_tasks_reward() -> None:
    # right on even tasks, wrong on odd ones: the reward is the task's @reward, per episode
    engine = PolicyEngine(lambda c: _sum(c) if " 0 + " in c or " 2 + " in c else "7")
    groups = _run(Env("vf-sums"), engine, [0, 1, 2])
    assert [g.metadata["endings"] for g in groups] == [["done", "done"]] * 3
    assert [[s.reward for s in g.samples] for g in groups] == [[1.0, 1.0], [0.0, 0.0], [1.0, 1.0]]
    for g in groups:
        for s in g.samples:
            check_faithful(s, engine)
            assert s.reward_parts["turns"] == 1.0
            assert "What is" in engine.tok.decode(s.prompt_ids)  # verifiers' prompt, rendered by rlvr's server


def test_an_mcp_toolset_serves_the_episode_its_tools() -> None:
    # the form the chat template writes a call back in, so that the next call extends this one
    call = '<tool_call>\n{"name": "calc_toolset_add", "arguments": {"a": 10, "b": 20}}\n</tool_call>'
    shown: list[str] = []

    def policy(context: str) -> str:
        shown.append(context)
        return "The sum is " + context.rsplit("<|im_start|>tool\n", 1)[1].split("<|im_end|>")[0] \
            if "<|im_start|>tool" in context else call

    engine = PolicyEngine(policy)
    (group,) = _run(Env("vf-calc"), engine, [0], n=1)
    (s,) = group.samples
    assert group.metadata["endings"] == ["done"] and s.reward == 1.0  # "30", which only the tool computed
    assert s.reward_parts["turns"] == 2.0 and not s.segments  # one trajectory: the tool's turn masked in it
    # the toolset's schema reached the model
    assert '"calc_toolset_add"' in shown[0] and "Add two integers." in shown[0]
    check_faithful(s, engine)


def test_a_multi_turn_env_masks_its_turns() -> None:
    engine = PolicyEngine(lambda c: "done" if c.count("Go on.") >= 2 else "thinking")
    groups = _run(Env("vf-talk"), engine, [1])
    for s in groups[0].samples:
        assert s.reward_parts["turns"] == 3.0
        check_faithful(s, engine)
        c = s.completion
        masked = engine.tok.decode([t for t, m in zip(c.token_ids, c.loss_mask or ()) if m == 0])
        assert masked.count("Go on.") == 2  # the environment's turns are shown, not trained


def test_a_policy_that_never_finishes_ends_at_max_turns() -> None:
    engine = PolicyEngine(lambda c: "thinking")
    groups = _run(Env("vf-talk", max_turns=2), engine, [0])
    assert groups[0].metadata["endings"] == ["max_turns", "max_turns"]
    for s in groups[0].samples:
        assert s.reward_parts["turns"] == 2.0
        check_faithful(s, engine)


def test_a_tool_server_that_dies_fails_the_episode_not_the_model() -> None:
    # the first task's call kills the tool server; the second is answered without a tool
    engine = PolicyEngine(lambda c: '<tool_call>\n{"name": "calc_toolset_crash", "arguments": {}}\n</tool_call>'
                          if "10 + 20" in c else "33")
    env = Env({"id": "vf-calc", "size": 2})  # a taskset of its own: its tool server dies here
    # a step that starts the tool server (which outlives it): a fresh venv's first start compiles
    # its imports, which took more than 8 s on one CI run (session 36), so it has longer
    env.kwargs["timeout"] = 60
    _run(env, engine, [1], n=1)
    env.kwargs["timeout"] = 8  # verifiers' program retries a lost tool call for a while; rlvr's limit ends it
    crashed, answered = _run(env, engine, [0, 1], n=1)
    assert crashed.metadata["endings"][0] in FAILED and answered.metadata["endings"] == ["done"]
    (s,) = crashed.samples
    assert s.excluded and s.reward_parts.get("env/error") == 1.0  # no verdict, not a wrong answer
    assert answered.samples[0].reward == 1.0


def test_a_seat_that_is_not_the_policy_may_not_call_the_policy() -> None:
    from rlvr.agents.openai_agent import AgentError

    engine = PolicyEngine(lambda c: "done")
    with pytest.raises(AgentError, match="'critic' is not trainable but called the policy's server"):
        _run(Env("vf-duo"), engine, [0], n=1)


@pytest.mark.parametrize("block", [
    '{taskset = {id = "vf-sums"}, agent = {harness = {id = "null"}}}',  # a Taskset with verifiers' null harness
    '{taskset = {id = "vf-calc", size = 6}, agent = {harness = {id = "null"}}}',  # with an MCP Toolset
    '{taskset = {id = "vf-talk", size = 6}, agent = {harness = {id = "null"}}, turns = 2}',  # a multi-turn Env
], ids=["taskset", "mcp-toolset", "multi-turn-env"])
def test_training_on_a_v1_environment(tmp_path: Path, block: str) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_openai_agent import ascii_tokenizer
    from tests.test_train import overrides, read_metrics
    from tests.tiny import make_tiny_model

    model_dir = tmp_path / "tiny"
    tok = ascii_tokenizer()
    make_tiny_model(vocab_size=len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = [x for x in overrides(model_dir, tmp_path, "vf1", train__steps=2) if not x.startswith(("task.", "rewards"))]
    cfg = load_config(None, [*args, 'env.name="verifiers"', "task.eval_size=2", "env.max_total_tokens=16",
                             f"env.kwargs={{v1 = {block}}}"])
    assert cfg.task.source == "env"
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "vf1")
    assert len(rows) == 2 and rows[-1]["env/ending/done"] == 1.0  # every episode finished and was scored
    assert rows[-1]["env/turns"] == (2.0 if "vf-talk" in block else 1.0)  # the Env's turns, each the policy's


def test_the_packaged_example_and_its_taskset() -> None:
    """rlvr/configs/verifiers_sums.toml on examples/verifiers_sums (as after `pip install -e`)."""
    from rlvr.config import load_config

    cfg = load_config("verifiers_sums", [])
    examples = environment_examples(cfg.env.kwargs)
    assert len({e.prompt for e in examples}) == 100  # every pair of digits, once
    assert all(int(e.answer) == sum(map(int, e.prompt[8:].split("?")[0].split(" + "))) for e in examples)
    env = Env("verifiers-sums")
    env.kwargs = dict(cfg.env.kwargs)
    def even(text: str) -> bool:
        return text.rsplit("What is ", 1)[1][0] in "02468"

    engine = PolicyEngine(lambda c: _sum(c) if even(c) else "no idea")  # right where the first digit is even
    groups = _run(env, engine, list(range(12)), n=1)
    rewards = [g.samples[0].reward for g in groups]
    assert rewards == [float(even(g.prompt)) for g in groups] and 0 < sum(rewards) < len(rewards)


def test_a_classic_config_on_verifiers_0_4_says_what_to_do() -> None:
    import verifiers

    if hasattr(verifiers, "Environment"):
        pytest.skip(f"verifiers {verifiers.__version__} has the classic API (make test-verifiers04 runs this)")
    with pytest.raises(ImportError, match="no longer has: pin verifiers==0.3.1, or train a v1 Taskset"):
        environment_examples({"load": "my_env:load_environment"})


def test_a_bad_v1_block_is_refused() -> None:
    with pytest.raises(ValueError, match="needs taskset"):
        environment_examples({"v1": {"agent": {}}})
    with pytest.raises(ValueError, match="unknown keyword 'load'"):
        environment_examples({"v1": {"taskset": {"id": "vf-sums"}}, "load": "x:y"})
    with pytest.raises(ModuleNotFoundError, match="taskset 'no-such-taskset' not found"):
        environment_examples({"v1": {"taskset": {"id": "no-such-taskset"}}})
