"""What a run trains on: its examples (training and held-out) rendered as the engine's prompts,
its rewards and sampling settings, the prompt sampler over them, and the builder of multi-turn
episodes when the task is an environment."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from transformers import PreTrainedTokenizerBase

from rlvr.agents.envs import env_factory
from rlvr.agents.openai_agent import ENV_DATASETS, EPISODE_BUILDERS
from rlvr.agents.runner import ChatDelta, Limits, Summarize, episode_groups
from rlvr.agents.search import facts_examples
from rlvr.agents.wordnet import wordnet_examples
from rlvr.data.domains import DOMAINS, domain_examples
from rlvr.data.transforms import shows_problem_only, transform
from rlvr.algos.registry import check_keywords, keyword_options
from rlvr.config import RunConfig
from rlvr.options import rlp_options
from rlvr.data import Example, jsonl_examples, reasoning_gym_examples, render_example, render_prompt
from rlvr.data.curricula import SamplerContext, build_sampler
from rlvr.data.images import load_image, prompt_media, render_with_images, template_ids
from rlvr.data.pretraining import prompt_ids, text_examples
from rlvr.data.sampler import Sampler, UniformSampler
from rlvr.data.tasks import (
    CODE_INSTRUCTION,
    hf_examples,
    humaneval_examples,
    parquet_examples,
    reasoning_gym_mixture,
)
from rlvr.data.visual import visual_examples
from rlvr.rewards import RewardFn
from rlvr.rewards.builtin import REWARDS
from rlvr.rewards.styles import PROMPT_MESSAGES
from rlvr.rollout.engine import Engine
from rlvr.types import Group, PromptMedia, SamplingParams


class Episodes(Protocol):
    """Multi-turn environments (env.name): n episodes of each prompt index, as groups (a game: one
    group per prompt and trained role, rlvr.agents.games). ``held_out``: for held-out evaluation
    (a game then plays its fixed evaluation opponent)."""

    def __call__(self, engine: Engine, examples: list[Example], indices: list[int], n: int, *,
                 sampling: SamplingParams | None = None, held_out: bool = False) -> list[Group]: ...


Variants = Callable[[int, int, np.random.Generator], list[list[int]]]
"""Prompt augmentation (sampler.templates): (prompt index, n, rng) → the n prompts its samples get."""


@dataclass(frozen=True)
class TaskData:
    """The task as the loop uses it: examples and their prompt token ids, rewards, sampling."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    eval_examples: list[Example]
    eval_ids: list[list[int]]
    rewards: list[RewardFn]
    params: SamplingParams
    """Sampling of a training step: temperature, top-p/k, the token budget, n = the group size."""
    episodes: Episodes | None = None
    variants: Variants | None = None
    media: list[PromptMedia | None] | None = None
    """Each training prompt's images (a vision-language model's task), aligned with prompt_ids;
    None when no prompt has any."""
    eval_media: list[PromptMedia | None] | None = None
    """The same for the held-out prompts."""

    def __post_init__(self) -> None:
        for name, ids, media in (("media", self.prompt_ids, self.media),
                                 ("eval_media", self.eval_ids, self.eval_media)):
            if media is not None and len(media) != len(ids):
                raise ValueError(f"TaskData.{name} has {len(media)} entries for {len(ids)} prompts")


def load_task(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, rewards: list[RewardFn],
              processor: Any = None) -> TaskData:
    """The run's examples rendered for the engine: a chat prompt, or (task.source = "text", RLP)
    the raw context and the thought's opening marker. Examples with images
    (``fields["images"]``) are rendered by a vision-language model's ``processor``, their images
    kept beside the ids (TaskData.media)."""
    examples, held = load_examples(cfg)
    check_answers(examples + held, rewards)
    with_images = [ex for ex in examples + held if ex.fields.get("images")]
    if with_images and processor is None:
        raise ValueError(f"{with_images[0].id}: the prompt has images, and {cfg.model!r} is a text-only model; "
                         "use a vision-language model (docs/vlm.md)")
    if with_images and (cfg.env.name or cfg.sampler.templates):
        raise ValueError("prompts with images do not combine with " +
                         ("env.name" if cfg.env.name else "sampler.templates") + " yet (docs/vlm.md)")
    if with_images:
        params = _sampling(cfg)
        train, train_media = render_with_processor(processor, examples, cfg.task.system_prompt)
        evals, eval_media = render_with_processor(processor, held, cfg.task.system_prompt)
        return TaskData(examples, train, held, evals, rewards, params, media=train_media, eval_media=eval_media)
    if cfg.task.source == "text":
        think_open = rlp_options(cfg.rewards).think_open

        def encode(exs: list[Example]) -> list[list[int]]:
            return [prompt_ids(tokenizer, ex.fields["context"], think_open) for ex in exs]
    else:
        def encode(exs: list[Example]) -> list[list[int]]:
            return [render_example(tokenizer, ex, cfg.task.system_prompt) for ex in exs]
    params = _sampling(cfg)
    return TaskData(examples, encode(examples), held, encode(held), rewards, params,
                    episodes=make_episodes(cfg, tokenizer, rewards, params))


def check_answers(examples: Sequence[Example], rewards: Sequence[RewardFn]) -> None:
    """A built-in reward that compares with the gold answer (math_verify, exact_answer,
    multiple_choice: its ``answer`` is required) gets one from every example it scores: a row
    with a null or blank answer is an error here, naming it, where it would score every sample 0
    as an error. (A HumanEval row's gold is its tests, and a user's reward reads what it likes.)"""
    import inspect

    for reward in rewards:
        if reward.fn not in REWARDS.values():
            continue
        answer = inspect.signature(reward.fn).parameters.get("answer")
        if answer is None or answer.default is not inspect.Parameter.empty:
            continue
        missing = [ex.id for ex in examples if ex.answer is None and reward.applies(ex.fields)]
        if missing:
            raise ValueError(f"reward {reward.name!r} compares with the gold answer, and {len(missing)} example(s) have "
                             f"none (null or blank), e.g. {', '.join(missing[:3])}")


def check_prompt_lengths(task: TaskData, context: int) -> None:
    """Every prompt of the task, training and held-out, has a token and fits the model's context
    (`context`, its positions) with the sampling budget (`prompts_fit`)."""
    for kind, examples, ids in (("training", task.examples, task.prompt_ids),
                                ("held-out", task.eval_examples, task.eval_ids)):
        prompts_fit(kind, examples, ids, context, task.params.max_new_tokens)


def prompts_fit(kind: str, examples: Sequence[Example], ids: Sequence[Sequence[int]], context: int, budget: int,
                budget_name: str = "sampling.max_new_tokens") -> None:
    """Every prompt (`ids`, one per example) has a token and fits `context` positions with
    `budget` new tokens: else a ValueError before anything is sampled, naming the examples, where
    the engine would have stopped the run at the step that drew one (an empty prompt) or sampled
    past the positions the model was trained on (a long one). Multi-turn episodes grow their
    contexts later; their own turn budgets bound that."""
    empty = [ex.id for ex, row in zip(examples, ids) if not row]
    if empty:
        raise ValueError(f"{len(empty)} {kind} prompt(s) render to no tokens, e.g. {', '.join(map(str, empty[:3]))}")
    over = [f"{ex.id} ({len(row)} tokens)" for ex, row in zip(examples, ids) if len(row) >= context]
    if over:
        raise ValueError(f"{len(over)} {kind} prompt(s) are longer than the model's context of {context} "
                         f"positions, e.g. {', '.join(over[:3])}: shorten them or leave them out")
    long = [(ex.id, len(row)) for ex, row in zip(examples, ids) if len(row) + budget > context]
    if long:
        shown = ", ".join(f"{i} ({n} tokens)" for i, n in long[:3])
        raise ValueError(
            f"{len(long)} {kind} prompt(s) leave too little room for {budget_name} = {budget} in the "
            f"model's context of {context} positions, e.g. {shown}: lower {budget_name} to at most "
            f"{context - max(n for _, n in long)}, or leave those examples out")


def _sampling(cfg: RunConfig) -> SamplingParams:
    s = cfg.sampling
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                          stop=tuple(s.stop), n=cfg.algo.group_size)


def render_with_processor(processor: Any, examples: list[Example], system_prompt: str | None,
                          ) -> tuple[list[list[int]], list[PromptMedia | None] | None]:
    """Each example's prompt ids and its images (None without; the list None when no example
    has any), rendered by a vision-language model's processor."""
    ids: list[list[int]] = []
    media: list[PromptMedia | None] = []
    for ex in examples:
        images = ex.fields.get("images") or []
        if not images:
            ids.append(render_example(processor.tokenizer, ex, system_prompt))
            media.append(None)
            continue
        pictures = [load_image(image, f"{ex.id}: image {k}") for k, image in enumerate(images)]
        row, inputs = render_with_images(processor, ex.prompt, pictures, system_prompt, where=ex.id)
        ids.append(row)
        media.append(prompt_media(pictures, inputs, len(row),
                                  template_ids(processor, ex.prompt, len(pictures), system_prompt)))
    return ids, media if any(m is not None for m in media) else None


def with_variants(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, task: TaskData, context: int) -> TaskData:
    """The task with its prompt templates (sampler.templates), once its training examples are final:
    every example under every template rendered now, and checked against the model's ``context``
    with the sampling budget (`prompts_fit`)."""
    templates = cfg.sampler.templates
    if not templates:
        return task
    if task.media is not None:
        raise ValueError("sampler.templates re-renders prompts as text, which would drop their images")
    chats = [ex.id for ex in task.examples if len(ex.fields.get(PROMPT_MESSAGES) or ()) > 1]
    if chats:
        raise ValueError(f"sampler.templates re-renders a prompt from its last user message, which would drop the "
                         f"rest of a conversation; {len(chats)} prompts are conversations, e.g. {chats[0]}")

    def render(text: str) -> list[int]:
        return render_prompt(tokenizer, text, cfg.task.system_prompt)

    rendered: dict[tuple[int, int], list[int]] = {}  # filled below, read by the variants
    variants = template_variants(templates, render, task.examples, rendered)
    for k, template in enumerate(templates):
        ids = [render(template.replace("{prompt}", ex.prompt)) for ex in task.examples]
        prompts_fit(f"training (sampler.templates[{k}])", task.examples, ids, context, task.params.max_new_tokens)
        rendered.update({(i, k): row for i, row in enumerate(ids)})
    return dataclasses.replace(task, variants=variants)

logger = logging.getLogger("rlvr.train")


def load_examples(cfg: RunConfig) -> tuple[list[Example], list[Example]]:
    """Training and held-out examples; no held-out prompt text appears in training."""
    t = cfg.task
    pool = _task_pool(cfg)
    keys = [prompt_key(ex) for ex in pool]  # an image's digest is computed once
    held: list[Example] = []
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for ex, key in zip(pool, keys):
        if len(held) >= t.eval_size:
            break
        if key not in seen:
            held.append(ex)
            seen.add(key)
    train = [ex for ex, key in zip(pool, keys) if key not in seen]
    generated = t.source == "reasoning_gym"  # task.size sets how many are made; a file or dataset has its rows
    more = "raise task.size, lower task.eval_size, or widen the task's parameters" if generated else \
        "lower task.eval_size or add rows"
    if not train:
        raise ValueError(f"no training prompts left after holding out {len(held)} for evaluation; {more}")
    distinct = len({key for key in keys if key not in seen})
    if distinct < 4 * cfg.train.prompts_per_step:  # a few steps' worth: almost surely not what was meant
        logger.warning("only %d distinct training prompts (of %d %s, less duplicates and the %d held out): %s "
                       "if that is not intended.", distinct, len(pool), "made" if generated else "rows", len(held), more)
    return train, held


def _task_pool(cfg: RunConfig) -> list[Example]:
    """Every example the task's source gives (training and held-out alike), with the instruction
    the task asks for (or the source's default)."""
    t = cfg.task
    default = CODE_INSTRUCTION if t.source == "humaneval" else "Put the final answer inside <answer></answer> tags."
    if t.source == "domain" and t.name in DOMAINS:
        default = DOMAINS[t.name][1]
    if t.params.get("format", "rlvr") != "rlvr" or shows_problem_only(t.transforms):  # another trainer's data:
        default = ""  # its prompts are used as they are; a critique shows the problem without the request to solve it
    instruction = default if t.instruction is None else t.instruction
    pool = _source_pool(cfg, instruction)
    for spec in t.transforms:  # prompt builders (rlvr.data.transforms), in order
        build = transform(spec.fn)
        check_keywords(f"task.transforms {spec.fn!r}", build, spec.kwargs,
                       [k for k in keyword_options(build, required=True) if k != "seed"])
        pool = build(pool, seed=cfg.seed, **spec.kwargs)
    return pool


def _source_pool(cfg: RunConfig, instruction: str) -> list[Example]:
    """The task source's examples, each prompt followed by ``instruction``."""
    t = cfg.task
    if t.source == "reasoning_gym" and t.mixture:
        pool = reasoning_gym_mixture([(m.name, m.weight, m.params) for m in t.mixture], size=t.size + t.eval_size,
                                     seed=cfg.seed, instruction=instruction)
    elif t.source == "reasoning_gym":
        pool = reasoning_gym_examples(t.name, size=t.size + t.eval_size, seed=cfg.seed, params=t.params,
                                      instruction=instruction)
    elif t.source == "humaneval":
        pool = humaneval_examples(instruction=instruction)
    elif t.source == "visual":  # synthetic images drawn in-process (rlvr.data.visual)
        pool = visual_examples(t.name, size=t.size + t.eval_size, seed=cfg.seed, params=dict(t.params),
                               instruction=instruction)
    elif t.source == "facts":  # questions about an invented world (the search environment's corpus)
        pool = facts_examples(size=t.size + t.eval_size, seed=cfg.seed, **t.params)
    elif t.source == "wordnet":  # reverse-dictionary questions over WordNet's nouns (a real search corpus)
        check_keywords('task.params for source "wordnet"', wordnet_examples, t.params,
                       [k for k in keyword_options(wordnet_examples) if k not in ("size", "seed", "instruction")])
        pool = wordnet_examples(size=t.size + t.eval_size, seed=cfg.seed, instruction=instruction, **t.params)
    elif t.source == "domain":  # small generated tasks for the domain rewards (rlvr.data.domains)
        pool = domain_examples(t.name, size=t.size + t.eval_size, seed=cfg.seed, instruction=instruction)
    elif t.source == "env":  # the environment brings its own prompts (e.g. a verifiers environment's dataset)
        if cfg.env.name not in ENV_DATASETS:
            raise ValueError(f"task.source = \"env\" takes the environment's own prompts; env.name = {cfg.env.name!r} "
                             f"has none (environments with a dataset: {', '.join(ENV_DATASETS)})")
        pool = ENV_DATASETS[cfg.env.name](dict(cfg.env.kwargs), t.size + t.eval_size)
    elif t.source == "text":  # RL on pre-training data: cuts through documents (no instruction)
        assert t.path is not None
        check_keywords('task.params for source "text"', text_examples, t.params)
        pool = text_examples(t.path, size=t.size + t.eval_size, seed=cfg.seed, **t.params)
    else:  # rows of a file or dataset: task.params name their columns (and a dataset's split)
        assert t.path is not None
        readers: dict[str, Callable[..., list[Example]]] = {"hf": hf_examples, "parquet": parquet_examples,
                                                            "jsonl": jsonl_examples}
        read = readers[t.source]
        check_keywords(f"task.params for source {t.source!r}", read, t.params,
                       [k for k in keyword_options(read) if k != "instruction"])
        pool = read(t.path, instruction=instruction, **t.params)
    return pool


def prompt_key(ex: Example) -> tuple[str, tuple[str, ...]]:
    """What makes two prompts the same: the text, or the whole conversation where the prompt is
    chat messages (one question under two system turns is two prompts), and the images' content
    (a digest of each image's pixels or bytes) where it has any: one question asked of two
    images is two prompts."""
    images = ex.fields.get("images") or ()
    messages = ex.fields.get(PROMPT_MESSAGES)
    text = ex.prompt if messages is None else json.dumps(messages, sort_keys=True)
    return text, tuple(_digest(image) for image in images)


def _digest(image: Any) -> str:
    from PIL import Image

    if isinstance(image, Image.Image):
        data = image.tobytes() + repr((image.mode, image.size)).encode()
    elif isinstance(image, dict):  # a `datasets` Image value
        data = image.get("bytes") or str(image.get("path")).encode()
    elif isinstance(image, bytes | bytearray):
        data = bytes(image)
    else:  # a path: the same path is the same image
        data = str(image).encode()
    return hashlib.sha1(data).hexdigest()


def make_episodes(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase, rewards: list[RewardFn],
                  params: SamplingParams) -> Episodes | None:
    """With env.name: the builder of episodes (rlvr.agents); else None."""
    e = cfg.env
    if e.name is None:
        return None
    if cfg.sampler.templates:
        raise ValueError("sampler.templates and env.name do not combine: an environment writes its own prompt")
    if e.name in EPISODE_BUILDERS:  # the agent runs its own episodes (e.g. through rlvr's OpenAI server)
        return EPISODE_BUILDERS[e.name](e, tokenizer, rewards, params, system_prompt=cfg.task.system_prompt)
    factory = env_factory(e.name)
    limits = Limits(max_turns=e.max_turns, max_turn_tokens=cfg.sampling.max_new_tokens,
                    max_total_tokens=e.max_total_tokens, max_context=e.max_context, max_void_turns=e.max_void_turns)
    delta = ChatDelta(tokenizer, e.observation_role, cfg.task.system_prompt)
    summarize = None
    if e.summarize:
        summarize = Summarize(**e.summarize)

    def episodes(engine: Engine, examples: list[Example], indices: list[int], n: int, *,
                 sampling: SamplingParams | None = None, held_out: bool = False) -> list[Group]:
        return episode_groups(engine, tokenizer, factory, examples, indices, n, rewards, sampling or params, limits,
                              delta, engine.eos_token_ids, system_prompt=cfg.task.system_prompt,
                              kwargs=dict(e.kwargs), summarize=summarize, mask=tuple(e.mask))

    return episodes


def make_sampler(cfg: RunConfig, examples: list[Example]) -> Sampler:
    """The configured prompt sampler over the training examples (rlvr.data.curricula)."""
    sc = cfg.sampler
    if sc.name == "uniform" and not sc.kwargs:
        return UniformSampler(len(examples), cfg.seed)
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


def template_variants(templates: list[str], render: Callable[[str], list[int]], examples: list[Example],
                      rendered: dict[tuple[int, int], list[int]] | None = None,
                      ) -> Callable[[int, int, np.random.Generator], list[list[int]]]:
    """Prompt augmentation (Lu et al., "Prompt Augmentation Scales up GRPO Training on
    Mathematical Reasoning"): each rollout of a prompt is sampled under a reasoning template drawn
    uniformly from ``templates`` (``{prompt}`` marks where the prompt goes), so a group mixes
    ways of reasoning. Rewards still see the original prompt. Rendered prompts are cached
    (``rendered``: by example index and template index, made already)."""
    for t in templates:
        if "{prompt}" not in t:
            raise ValueError(f"prompt template {t!r} has no {{prompt}}")
    cache: dict[tuple[int, int], list[int]] = rendered if rendered is not None else {}

    def variants(index: int, n: int, rng: np.random.Generator) -> list[list[int]]:
        out = []
        for k in rng.integers(len(templates), size=n).tolist():
            if (index, k) not in cache:
                cache[index, k] = render(templates[k].replace("{prompt}", examples[index].prompt))
            out.append(cache[index, k])
        return out

    return variants
