"""`rlvr filter`: offline difficulty filtering. Estimate each training prompt's pass rate with a
model (n samples at the config's temperature, scored by the config's rewards) and keep the
prompts whose rate lies in a band, as a JSONL file that `task.source = "jsonl"` trains on.

Pass-rate filtering before RL is common practice: Kimi k1.5 (arXiv:2501.12599) measures difficulty
as the pass rate over 10 samples at high temperature; Reinforce-Ada (arXiv:2510.04996) builds its
hard and easy sets with pass-rate thresholds of 0.125 and 0.313. Prompts always solved or never
solved give GRPO no gradient, so the default band keeps 0 < rate < 1.

The same sampling is ReST's Grow step (Gulcehre et al. 2023, arXiv:2308.08998) and expert
iteration's sampling (Anthony et al. 2017; STaR, arXiv:2203.14465): `write_accepted` keeps every
distinct completion judged correct as a prompt/completion row, and `rlvr sft` on that file is the
Improve step (examples/expert_iteration.sh repeats the two).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from rlvr.config import RunConfig
from rlvr.data import Example
from rlvr.data.chat import with_system
from rlvr.data import render_example
from rlvr.types import SamplingParams
from rlvr.models import resolve_model
from rlvr.models import context_length, eos_token_ids, load_model, load_tokenizer, resolve_dtype
from rlvr.rewards import build_rewards
from rlvr.rewards.extract import extract_answer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.data import prompts_fit
from rlvr.train.rollouts import generate_groups, is_correct, judged
from rlvr.rewards.styles import PROMPT_MESSAGES


class Rated(NamedTuple):
    example: Example
    rate: float | None
    """The fraction of the samples the first reward judged that it gave full marks; None when it
    judged none (its sandbox or service failed on every one: `has_verdict`), which no band keeps."""
    accepted: tuple[str, ...] = ()
    """The distinct completions judged correct that ended on their own (not cut at
    max_new_tokens), in the order sampled."""


def sampled_groups(model_spec: str, cfg: RunConfig, examples: list[Example], *, n: int, batch: int = 32,
                   progress: Callable[[int], None] | None = None) -> Iterator[tuple[Example, Any, str]]:
    """(example, its group of n scored samples, the first reward's name) for each of
    ``examples``, sampled by ``model_spec`` under the config's sampling and rewards, ``batch``
    prompts at a time."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    path = resolve_model(model_spec)
    tokenizer = load_tokenizer(path)
    model = load_model(path, resolve_dtype("auto")).eval()
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer), seed=cfg.seed)
    ids = [render_example(tokenizer, ex, cfg.task.system_prompt) for ex in examples]
    s = cfg.sampling
    prompts_fit("training", examples, ids, context_length(model), s.max_new_tokens)
    rewards = build_rewards(cfg.reward_specs(), on_error=cfg.on_reward_error)
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens,
                            stop=tuple(s.stop), n=n)
    for start in range(0, len(examples), batch):
        chunk = list(range(start, min(start + batch, len(examples))))
        for i, group in zip(chunk, generate_groups(engine, examples, ids, chunk, rewards, params,
                                                   on_error=cfg.on_reward_error)):
            yield examples[i], group, rewards[0].name
        if progress:
            progress(len(chunk))


def pass_rates(model_spec: str, cfg: RunConfig, examples: list[Example], *, n: int, batch: int = 32,
               progress: Callable[[int], None] | None = None) -> list[Rated]:
    """Each of ``examples`` (`rlvr filter`: the config's training prompts, the first ``--limit``)
    rated by n samples under the config's sampling and rewards, generated ``batch`` prompts at a time."""
    out = []
    for example, group, primary in sampled_groups(model_spec, cfg, examples, n=n, batch=batch, progress=progress):
        kept = judged(group.samples, primary)  # a failed sandbox is not a wrong answer
        correct = [x for x in kept if is_correct(x, primary)]
        # a cut-off completion is no demonstration: SFT would teach ending it there
        finished = [x.completion.text for x in correct if x.completion.finish_reason == "stop"]
        out.append(Rated(example, len(correct) / len(kept) if kept else None, tuple(dict.fromkeys(finished))))
    return out


def preference_pairs(model_spec: str, cfg: RunConfig, examples: list[Example], *, n: int, per_prompt: int,
                     seed: int = 0, batch: int = 32, progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Preference rows made from a model's own samples, judged by the config's rewards (`rlvr rm
    pairs`): for each prompt, up to ``per_prompt`` pairs of distinct completions whose total
    rewards differ, the higher one chosen, drawn at random (by ``seed``) from all such pairs.
    A sample some reward could not judge (its sandbox or service failed) is left out. Each row:
    "prompt" (the user message), "chosen", "rejected", "score_chosen", "score_rejected", "id"."""
    rng = random.Random(seed)
    rows = []
    for example, group, _ in sampled_groups(model_spec, cfg, examples, n=n, batch=batch, progress=progress):
        scored: dict[str, float] = {}
        for x in group.samples:
            if not any(key.endswith(("/excluded", "/error")) for key in x.reward_parts):
                scored.setdefault(x.completion.text, x.reward)
        texts = list(scored)
        candidates = [(a, b) for i, a in enumerate(texts) for b in texts[i + 1 :] if scored[a] != scored[b]]
        for a, b in rng.sample(candidates, min(per_prompt, len(candidates))):
            chosen, rejected = (a, b) if scored[a] > scored[b] else (b, a)
            rows.append({"prompt": example.prompt, "chosen": chosen, "rejected": rejected,
                         "score_chosen": scored[chosen], "score_rejected": scored[rejected], "id": example.id})
    return rows


def verdict_rows(model_spec: str, cfg: RunConfig, examples: list[Example], *, n: int, extract: str | None = None,
                 balance: bool = True, seed: int = 0, batch: int = 32,
                 progress: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Critique rows made from a model's own samples, labelled by the config's first reward (full
    marks: "correct"), for training a generative verifier (`rlvr rm verdicts`; docs/rewards.md).
    Each distinct (prompt, candidate) once; the candidate is the completion, or its answer as
    ``extract`` reads it (a sample with none is left out, as one the first reward gave no verdict).
    ``balance``: as many wrong rows as right ones, drawn at random by ``seed`` (a judge trained on
    mostly wrong answers learns to say "incorrect", and ranks them no better: docs/LOG.md,
    session 36). Each row: "prompt", "candidate", "label" (true: correct), "id" (unique)."""
    if extract is not None:
        extract_answer("", extract)  # an unknown extractor fails now, not after the sampling
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for example, group, primary in sampled_groups(model_spec, cfg, examples, n=n, batch=batch, progress=progress):
        for x in judged(group.samples, primary):
            candidate = x.completion.text.strip() if extract is None else extract_answer(x.completion.text, extract)
            if candidate:
                rows.setdefault((example.prompt, candidate), {"prompt": example.prompt, "candidate": candidate,
                                                              "label": is_correct(x, primary), "id": example.id})
    out = list(rows.values())
    rng = random.Random(seed)
    if balance:
        right, wrong = [r for r in out if r["label"]], [r for r in out if not r["label"]]
        fewer = min(len(right), len(wrong))
        out = rng.sample(right, fewer) + rng.sample(wrong, fewer)
    rng.shuffle(out)
    return [{**row, "id": f"{row['id']}/{k}"} for k, row in enumerate(out)]


def write_filtered(rated: list[Rated], out: str | Path, *, low: float, high: float,
                   include_low: bool = False, include_high: bool = False) -> int:
    """Write the examples whose pass rate lies between ``low`` and ``high`` (bounds excluded
    unless ``include_low``/``include_high``) to ``out`` as JSONL; returns how many. Each row has
    the example's fields (what its reward functions read), "prompt" (instruction included: train
    with ``task.instruction = ""``; chat messages for a conversation, read back with the same
    ``task.params.format``), "answer", "id" and "pass_rate" (`_row`)."""
    if not (0.0 <= low <= high <= 1.0):
        raise ValueError(f"need 0 <= low <= high <= 1, got low={low}, high={high}")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    kept = 0
    with out.open("w") as f:
        for ex, rate, _ in rated:
            if rate is None:  # no verdict on any sample: its difficulty is unknown
                continue
            above = rate > low or (include_low and math.isclose(rate, low))
            below = rate < high or (include_high and math.isclose(rate, high))
            if above and below:
                f.write(json.dumps(_row(ex) | {"pass_rate": rate}, default=str) + "\n")
                kept += 1
    return kept


def _row(ex: Example) -> dict[str, Any]:
    """An example as a row its loader reads back to the same example: its fields, "id", and the
    prompt as the text the policy saw, or as its chat messages where it was a conversation (TRL
    and verl layouts; the text alone would drop the system turn and earlier turns); "answer" as
    the fields hold it (a TRL row's own list or number, not its text)."""

    row = {**ex.fields, "id": ex.id}
    messages = row.pop(PROMPT_MESSAGES, None)
    row["prompt"] = ex.prompt if messages is None else messages
    return row


def write_accepted(rated: list[Rated], out: str | Path, *, system_prompt: str | None = None) -> int:
    """Write every accepted completion as a conversation `rlvr sft` trains on: {"prompt",
    "completion"} (or "messages" with the system prompt first), plus the prompt's "id" and
    "pass_rate"; returns how many rows. A prompt that occurs more than once (small tasks repeat
    prompts) contributes each distinct completion once."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    seen: set[tuple[str, str]] = set()
    with out.open("w") as f:
        for ex, rate, accepted in rated:
            for completion in accepted:
                if (ex.prompt, completion) in seen:
                    continue
                seen.add((ex.prompt, completion))
                messages = with_system([{"role": "user", "content": ex.prompt},
                                        {"role": "assistant", "content": completion}], system_prompt)
                turns: dict[str, Any] = {"messages": messages} if len(messages) > 2 else \
                    {"prompt": ex.prompt, "completion": completion}
                f.write(json.dumps({**turns, "id": ex.id, "pass_rate": rate}, default=str) + "\n")
    return len(seen)
