"""Sample groups of completions, score them, and summarise them as metrics."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from rlvr.data import Example
from rlvr.rewards import RewardFn, extract_answer
from rlvr.rewards.combine import ToScore, score_groups
from rlvr.rollout.engine import Engine
from rlvr.types import Group, PromptMedia, Sample, SamplingParams


def generate_groups(
    engine: Engine,
    examples: list[Example],
    prompt_ids: list[list[int]],
    indices: list[int],
    rewards: list[RewardFn],
    params: SamplingParams,
    progress: Callable[[int], None] | None = None,
    on_error: str = "zero",
    per_sample_prompts: list[list[list[int]]] | None = None,
    media: list[PromptMedia | None] | None = None,
) -> list[Group]:
    """`params.n` scored completions for each prompt index, one Group per prompt.

    ``per_sample_prompts[k]`` (prompt augmentation) gives the n prompts the samples of the k-th
    index are drawn from, in place of its own; rewards still see the example's prompt.
    ``media[i]``: prompt i's images (TaskData.media), sampled from and kept on its samples."""
    chosen: list[PromptMedia | None] = [None] * len(indices) if media is None else [media[i] for i in indices]
    if per_sample_prompts is None:
        extra: dict[str, Any] = {"media": chosen} if any(m is not None for m in chosen) else {}  # text engines need not know it
        completions = engine.generate([prompt_ids[i] for i in indices], params, progress, **extra)
        sample_prompts = [[prompt_ids[i]] * params.n for i in indices]
    else:
        if media is not None:
            raise ValueError("prompt augmentation (per_sample_prompts) does not take images")
        flat = engine.generate([p for row in per_sample_prompts for p in row], dataclasses.replace(params, n=1),
                               progress)
        completions = [[flat[k * params.n + j][0] for j in range(params.n)] for k in range(len(indices))]
        sample_prompts = per_sample_prompts
    every = score_groups(rewards, [ToScore(examples[i].prompt, [c.text for c in group], examples[i].fields,
                                           [c.token_ids for c in group]) for i, group in zip(indices, completions)],
                         on_error)
    groups = []
    for i, group, prompts, images, scored in zip(indices, completions, sample_prompts, chosen, every):
        ex = examples[i]
        samples = [Sample(tuple(p), c, total, parts, i, media=images)
                   for p, c, (total, parts) in zip(prompts, group, scored)]
        groups.append(Group(ex.prompt, tuple(samples), {"id": ex.id, "answer": ex.answer}))
    return groups


def _primary_key(sample: Sample, primary: str) -> str:
    """The correctness reward's name in a sample's parts: ``primary``; an episode's own verdict
    (``correct``) where its environment reports one; or where rewards are routed per source and
    ``primary`` does not score this sample, the first one that does."""
    parts = sample.reward_parts
    if primary in parts or f"{primary}/no_value" in parts:
        return primary
    if "correct" in parts and "env" in parts:  # an environment's own verdict (rlvr.agents.runner._verdict)
        return "correct"
    return next((k.removesuffix("/no_value") for k in parts if "/" not in k or k.endswith("/no_value")), primary)


def is_correct(sample: Sample, primary: str) -> bool:
    """A sample is correct when the first (correctness) reward gives full marks (`_primary_key`)."""
    return sample.reward_parts.get(_primary_key(sample, primary), 0.0) >= 1.0 - 1e-6


def judged_by(parts: Mapping[str, float], name: str) -> bool:
    """Whether reward `name` gave a verdict, among a sample's reward parts: it did not flag it
    ``<name>/excluded`` (it returned None, or its sandbox or service failed), or the flag only
    keeps the sample out of the loss (``<name>/masked``: `env.mask` on an unfinished episode,
    which the policy failed), and gave a value (not ``<name>/no_value``: a TRL-style None)."""
    if f"{name}/no_value" in parts:
        return False
    return f"{name}/excluded" not in parts or f"{name}/masked" in parts


def has_verdict(sample: Sample, primary: str) -> bool:
    """Whether the correctness reward (`_primary_key`) judged the sample (`judged_by`). Another
    reward's missing verdict (a weight-0.1 style judge down) leaves the correctness verdict
    standing."""
    return judged_by(sample.reward_parts, _primary_key(sample, primary))


def judged(samples: Iterable[Sample], primary: str) -> list[Sample]:
    """The samples the correctness reward gave a verdict (`has_verdict`). Accuracy counts these
    only, so a sandbox or a judge that fails is never counted as the model's wrong answer."""
    return [s for s in samples if has_verdict(s, primary)]


def scored(sample: Sample) -> bool:
    """Whether every reward gave the sample a verdict (`judged_by`), so its total reward is its
    own. Reward means are over these samples."""
    parts = sample.reward_parts
    return all(judged_by(parts, k.removesuffix("/excluded")) for k in parts if k.endswith("/excluded"))


def trained_rewards(group: Group) -> list[float]:
    """The rewards of a group's samples that the update trains on (not `Sample.excluded`, whose
    reward the update replaces by the others' mean): what its spread and baselines come from."""
    return [x.reward for x in group.samples if not x.excluded]


def judged_accuracy(samples: Iterable[Sample], primary: str) -> float | None:
    """The share of judged samples (`judged`) that are correct (`is_correct`); None when no
    sample got a verdict."""
    kept = judged(samples, primary)
    return statistics.fmean(is_correct(s, primary) for s in kept) if kept else None


def group_metrics(groups: list[Group], primary: str) -> dict[str, float]:
    """Reward, accuracy, length and group statistics of one step's rollouts (the policy's own
    samples: expert demonstrations mixed into groups are left out). Rewards are over the samples
    every reward judged (`scored`; no key when none), accuracy over the samples
    the correctness reward judged (`judged_accuracy`; no key when it judged none), and
    `no_verdict_fraction` the share it did not; `excluded_fraction` is the share out of the loss
    for any reason (no verdict from any reward, or `env.mask`)."""
    groups = [Group(g.prompt, tuple(s for s in g.samples if not s.off_policy), g.metadata) for g in groups]
    samples = [s for g in groups for s in g.samples]
    lengths = [len(s.completion.token_ids) for s in samples]
    names = sorted({k for s in samples for k in s.reward_parts})
    metrics = {
        "response_length": statistics.fmean(lengths),
        "response_length_max": float(max(lengths)),
        "truncated_fraction": statistics.fmean(s.completion.finish_reason == "length" for s in samples),
        # a group without signal: the rewards the update trains on are all equal (or fewer than two)
        "zero_std_fraction": statistics.fmean(len(set(trained_rewards(g))) <= 1 for g in groups),
        "excluded_fraction": statistics.fmean(s.excluded for s in samples),
        # collapse monitors: the share of distinct completions, and of distinct final answers (the
        # <answer> tag or else the last number; completions with neither count together as one answer)
        "distinct_completion_fraction": statistics.fmean(len({s.completion.text for s in g.samples}) / len(g.samples)
                                                         for g in groups),
        "distinct_answer_fraction": statistics.fmean(
            len({extract_answer(s.completion.text, "tag_or_last_number") for s in g.samples}) / len(g.samples)
            for g in groups),
        "tokens_generated": float(sum(lengths)),
    }
    rewards = [s.reward for s in samples if scored(s)]  # a missing verdict's 0 is no reward earned
    if rewards:
        metrics |= {"reward": statistics.fmean(rewards), "reward_std": statistics.pstdev(rewards)}
    # each group's verdicts on the samples the correctness reward judged (`judged_accuracy`)
    verdicts = [[is_correct(s, primary) for s in judged(g.samples, primary)] for g in groups]
    kept = [v for group in verdicts for v in group]
    if kept:
        metrics["accuracy"] = statistics.fmean(kept)
    metrics["no_verdict_fraction"] = 1 - len(kept) / len(samples)
    # why groups carry no signal: none of their judged samples right (too hard), or all (too easy)
    if judged_groups := [v for v in verdicts if v]:
        metrics["unsolved_fraction"] = statistics.fmean(not any(v) for v in judged_groups)
        metrics["solved_fraction"] = statistics.fmean(all(v) for v in judged_groups)
    for name in names:
        if "/" in name:  # "<name>/error", "<name>/excluded": an absent key counts as 0
            metrics[f"rewards/{name}"] = statistics.fmean(s.reward_parts.get(name, 0.0) for s in samples)
            continue
        # a reward's mean over the samples it scores (all of them unless routed) and gave a verdict
        values = [s.reward_parts[name] for s in samples if name in s.reward_parts and judged_by(s.reward_parts, name)]
        if values:
            metrics[f"rewards/{name}"] = statistics.fmean(values)
    return metrics
