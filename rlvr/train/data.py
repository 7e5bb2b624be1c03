"""What a run trains on: its examples (training and held-out), the prompt sampler over them, and
the builder of multi-turn episodes when the task is an environment."""

from __future__ import annotations

import logging
from typing import Any

from rlvr.agents.envs import env_factory
from rlvr.agents.runner import ChatDelta, Limits, Summarize, episode_groups
from rlvr.config import RunConfig
from rlvr.data import Example, jsonl_examples, reasoning_gym_examples
from rlvr.data.sampler import Sampler, UniformSampler
from rlvr.data.tasks import (
    CODE_INSTRUCTION,
    hf_examples,
    humaneval_examples,
    parquet_examples,
    reasoning_gym_mixture,
)
from rlvr.rewards import RewardFn
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import Group, SamplingParams

logger = logging.getLogger("rlvr.train")


def load_examples(cfg: RunConfig) -> tuple[list[Example], list[Example]]:
    """Training and held-out examples; no held-out prompt text appears in training."""
    t = cfg.task
    default = CODE_INSTRUCTION if t.source == "humaneval" else "Put the final answer inside <answer></answer> tags."
    instruction = default if t.instruction is None else t.instruction
    if t.source == "reasoning_gym" and t.mixture:
        pool = reasoning_gym_mixture([(m.name, m.weight, m.params) for m in t.mixture], size=t.size + t.eval_size,
                                     seed=cfg.seed, instruction=instruction)
    elif t.source == "reasoning_gym":
        pool = reasoning_gym_examples(t.name, size=t.size + t.eval_size, seed=cfg.seed, params=t.params,
                                      instruction=instruction)
    elif t.source == "humaneval":
        pool = humaneval_examples(instruction=instruction)
    elif t.source == "facts":  # questions about an invented world (the search environment's corpus)
        from rlvr.agents.search import facts_examples

        pool = facts_examples(size=t.size + t.eval_size, seed=cfg.seed, **t.params)
    elif t.source == "text":  # RL on pre-training data: cuts through documents (no instruction)
        from rlvr.data.pretraining import text_examples

        assert t.path is not None
        r = cfg.rlp
        pool = text_examples(t.path, size=t.size + t.eval_size, seed=cfg.seed, context_chars=r.context_chars,
                             target_words=r.target_words, min_context_words=r.min_context_words,
                             column="text" if t.prompt_column == "prompt" else t.prompt_column)
    elif t.source == "hf":
        assert t.path is not None
        pool = hf_examples(t.path, split=t.split, prompt_column=t.prompt_column, answer_column=t.answer_column,
                           instruction=instruction)
    else:
        assert t.path is not None
        read = parquet_examples if t.source == "parquet" else jsonl_examples
        pool = read(t.path, prompt_column=t.prompt_column, answer_column=t.answer_column, instruction=instruction)
    held: list[Example] = []
    seen: set[str] = set()
    for ex in pool:
        if len(held) >= t.eval_size:
            break
        if ex.prompt not in seen:
            held.append(ex)
            seen.add(ex.prompt)
    train = [ex for ex in pool if ex.prompt not in seen]
    if not train:
        raise ValueError(f"no training prompts left after holding out {len(held)} for evaluation; "
                         "raise task.size, lower task.eval_size, or widen the task's parameters")
    distinct = len({ex.prompt for ex in train})
    if distinct < 4 * cfg.train.prompts_per_step:  # a few steps' worth: almost surely not what was meant
        logger.warning("only %d distinct training prompts (task.size = %d, less duplicates and the %d held-out "
                       "texts): the task has few distinct prompts. Widen task.params or lower task.eval_size "
                       "if that is not intended.", distinct, t.size, len(held))
    return train, held


def make_episodes(cfg: RunConfig, engine: EmbeddedEngine, tokenizer: Any, examples: list[Example],
                  rewards: list[RewardFn], params: SamplingParams) -> Any:
    """With env.name: (prompt indices, n) → groups of n episodes each (rlvr.agents); else None."""
    e = cfg.env
    if e.name is None:
        return None
    if cfg.sampler.templates:
        raise ValueError("sampler.templates and env.name do not combine: an environment writes its own prompt")
    factory = env_factory(e.name)
    limits = Limits(max_turns=e.max_turns, max_turn_tokens=cfg.sampling.max_new_tokens,
                    max_total_tokens=e.max_total_tokens, max_context=e.max_context, max_void_turns=e.max_void_turns)
    delta = ChatDelta(tokenizer, e.observation_role, cfg.task.system_prompt)
    summarize = None
    if e.summarize_at:
        summarize = Summarize(at=e.summarize_at, rounds=e.summary_rounds, max_tokens=e.summary_tokens,
                              **({"instruction": e.summary_instruction} if e.summary_instruction else {}))

    def episodes(indices: list[int], n: int, *, on: list[Example] | None = None,
                 sampling: SamplingParams | None = None) -> list[Group]:
        return episode_groups(engine, tokenizer, factory, examples if on is None else on, indices, n, rewards,
                              sampling or params, limits, delta, engine.eos_token_ids,
                              system_prompt=cfg.task.system_prompt, kwargs=dict(e.kwargs), summarize=summarize,
                              mask_unfinished=e.mask_unfinished)

    return episodes


def make_sampler(cfg: RunConfig, examples: list[Example]) -> Sampler:
    """The configured prompt sampler over the training examples (rlvr.data.curricula)."""
    sc = cfg.sampler
    if sc.name == "uniform" and not sc.kwargs:
        return UniformSampler(len(examples), cfg.seed)
    from rlvr.data.curricula import SamplerContext, build_sampler

    difficulty = None
    if sc.difficulty_field is not None:
        missing = [ex.id for ex in examples if not isinstance(ex.fields.get(sc.difficulty_field), int | float)]
        if missing:
            raise ValueError(f"sampler.difficulty_field = {sc.difficulty_field!r}: example {missing[0]} has no "
                             f"numeric {sc.difficulty_field!r} ({len(missing)} of {len(examples)} lack it)")
        difficulty = [float(ex.fields[sc.difficulty_field]) for ex in examples]
    ctx = SamplerContext(texts=[ex.prompt for ex in examples],
                         sources=[str(ex.fields.get(sc.source_field, "default")) for ex in examples],
                         seed=cfg.seed, difficulty=difficulty)
    return build_sampler(sc.name, ctx, dict(sc.kwargs))
