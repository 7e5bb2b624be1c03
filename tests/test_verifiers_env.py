"""Environments from the `verifiers` package (its classic SingleTurnEnv, ToolEnv and MultiTurnEnv
with their Rubrics), built here, trained by rlvr unchanged: rollouts through rlvr's server, the
rubric's reward, the calls' exact token ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

vf = pytest.importorskip("verifiers")

from rlvr.agents.openai_agent import AgentLimits  # noqa: E402
from rlvr.agents.verifiers_env import environment_examples, verifiers_episodes  # noqa: E402
from rlvr.rewards.styles import PROMPT_MESSAGES  # noqa: E402
from rlvr.rollout.engine import EmbeddedEngine  # noqa: E402
from rlvr.types import SamplingParams  # noqa: E402
from tests.test_openai_agent import ascii_tokenizer  # noqa: E402
from tests.test_serve import ScriptedEngine  # noqa: E402
from tests.tiny import EOS_ID, make_tiny_model, make_tiny_tokenizer  # noqa: E402


def questions(n: int = 4) -> Any:
    import datasets

    return datasets.Dataset.from_list([{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(n)])


def distinct(completion: Any, **kwargs: Any) -> float:
    """A rubric function a random model gets different values of: distinct characters / 8."""
    return len(set(completion[-1]["content"] or "")) / 8.0 if completion else 0.0


def correct(completion: Any, answer: str, **kwargs: Any) -> float:
    return float(answer in (completion[-1]["content"] or ""))


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


class Retry(vf.MultiTurnEnv):
    """Asks twice: after the first answer, 'Are you sure?'."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        return [{"role": "user", "content": "Are you sure? Answer again."}]


def load_environment(kind: str = "single", n: int = 4) -> Any:
    """What a verifiers environment module's load_environment looks like."""
    if kind == "single":
        return vf.SingleTurnEnv(dataset=questions(n), system_prompt="Answer briefly.", rubric=vf.Rubric(funcs=[distinct]))
    if kind == "tool":
        return vf.ToolEnv(dataset=questions(n), tools=[add], max_turns=3, rubric=vf.Rubric(funcs=[correct]))
    return Retry(dataset=questions(n), max_turns=2, rubric=vf.Rubric(funcs=[distinct]))


class Env:
    """The env config section, as agent builders read it."""

    def __init__(self, kind: str, **kw: Any) -> None:
        self.kwargs = {"load": "tests.test_verifiers_env:load_environment", "args": {"kind": kind}}
        self.max_turns, self.max_total_tokens, self.max_context = kw.get("max_turns", 4), 64, 4096
        self.mask: list[str] = []


def roomy_tiny_model(vocab_size: int | None = None) -> Any:
    model = make_tiny_model(**({"vocab_size": vocab_size} if vocab_size else {}))
    model.config.max_position_embeddings = 4096  # verifiers' system prompts and tool schemas are long in bytes
    return model


def test_the_environments_dataset_becomes_the_prompts() -> None:
    examples = environment_examples(Env("single").kwargs)
    assert [e.prompt for e in examples] == [f"What is {i} + {i}?" for i in range(4)]
    assert examples[1].answer == "2" and examples[1].fields[PROMPT_MESSAGES][0] == {"role": "system",
                                                                                   "content": "Answer briefly."}


def test_a_single_turn_env_scored_by_its_rubric() -> None:
    tok = ascii_tokenizer()
    engine = EmbeddedEngine(roomy_tiny_model(len(tok)), tok, eos_token_ids=[tok.eos_token_id], seed=0)
    env = Env("single")
    episodes = verifiers_episodes(env, tok, [], SamplingParams(max_new_tokens=8, n=2))
    examples = environment_examples(env.kwargs)
    groups = episodes(engine, examples, [0, 1], 2)
    for g, ex in zip(groups, examples):
        assert g.metadata["endings"] == ["done", "done"]
        for s in g.samples:
            want = tok.apply_chat_template(ex.fields[PROMPT_MESSAGES], add_generation_prompt=True, tokenize=False)
            assert tok.decode(s.prompt_ids) == want  # the env's own messages, system turn included
            text = tok.decode(s.completion.token_ids, skip_special_tokens=True)
            assert s.reward == pytest.approx(len(set(text)) / 8.0)  # the rubric's reward of this very text


def test_a_tool_env_runs_its_tool_and_the_trajectory_is_one_segment() -> None:
    call = json.dumps({"name": "add", "arguments": {"a": 1, "b": 1}})
    engine = ScriptedEngine([])
    engine.texts = [f"<tool_call>\n{call}\n</tool_call>", "The answer is 2."]

    def scripted(prompts: list[list[int]], params: SamplingParams, progress: Any = None, *, seeds: Any = None) -> Any:
        from rlvr.types import Completion

        text = engine.texts[min(engine.calls, 1)]
        engine.calls += 1
        ids = engine.tok(text, add_special_tokens=False)["input_ids"] + [EOS_ID]
        return [[Completion(tuple(ids), (-0.5,) * len(ids), "stop", text)] for _ in prompts]
    engine.generate = scripted  # type: ignore[method-assign]
    env = Env("tool")
    env.max_total_tokens = 256
    episodes = verifiers_episodes(env, engine.tok, [], SamplingParams(max_new_tokens=128, n=1))
    (group,) = episodes(engine, environment_examples(env.kwargs), [1], 1)
    (s,) = group.samples
    assert group.metadata["endings"] == ["done"] and s.reward == 1.0  # "2" after the tool said 2
    assert engine.calls == 2 and not s.segments  # the second call extended the first exactly
    tok = make_tiny_tokenizer()
    prompt = tok.decode(s.prompt_ids)
    assert '"name": "add"' in prompt and "Add two integers." in prompt  # the tool's schema reached the model
    c = s.completion
    injected = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask or ()) if m == 0])
    assert "2" in injected and "<|im_start|>tool" in injected  # the tool's output, masked
    sampled = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask or ()) if m == 1])
    assert sampled == f"<tool_call>\n{call}\n</tool_call><|im_end|>The answer is 2.<|im_end|>"


def test_a_multi_turn_env_masks_its_responses() -> None:
    tok = ascii_tokenizer()
    engine = EmbeddedEngine(roomy_tiny_model(len(tok)), tok, eos_token_ids=[tok.eos_token_id], seed=1)
    env = Env("multi")
    groups = verifiers_episodes(env, tok, [], SamplingParams(max_new_tokens=6, n=2))(
        engine, environment_examples(env.kwargs), [2], 2)
    for s in groups[0].samples:
        assert s.reward_parts["turns"] == 2.0
        c = s.completion
        if s.segments:  # the first reply held a special token, which the resent history drops
            continue
        masked = tok.decode([t for t, m in zip(c.token_ids, c.loss_mask or ()) if m == 0])
        assert "Are you sure? Answer again." in masked


def test_training_on_a_verifiers_environment(tmp_path: Path) -> None:
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import overrides, read_metrics

    model_dir = tmp_path / "tiny"
    tok = ascii_tokenizer()
    roomy_tiny_model(len(tok)).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    args = [x for x in overrides(model_dir, tmp_path, "vf", train__steps=2) if not x.startswith(("task.", "rewards"))]
    cfg = load_config(None, [*args, 'env.name="verifiers"', "task.eval_size=2", "env.max_total_tokens=8",
                             'env.kwargs={load = "tests.test_verifiers_env:load_environment", args = {n = 12}}'])
    assert cfg.task.source == "env"  # the environment's dataset, by default
    train(cfg, quiet=True)
    rows = read_metrics(tmp_path / "vf")
    assert len(rows) == 2 and rows[-1]["env/ending/done"] == 1.0 and rows[-1]["reward_std"] > 0


def test_a_bad_verifiers_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs env.kwargs.load"):
        environment_examples({"args": {}})
    with pytest.raises(ValueError, match="not a verifiers Environment"):
        environment_examples({"load": "tests.test_verifiers_env:questions"})
