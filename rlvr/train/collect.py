"""How a step's groups are gathered (``sampler.rollouts``): the sampler picks prompts, the engine
samples, and a strategy may filter, re-sample or down-sample before the update sees them.

    plain          next_batch(n), G completions each
    dynamic        DAPO: set aside groups whose rewards are all equal and sample more prompts
    reinforce_ada  Reinforce-Ada: sample each prompt in rounds until its exit rule holds, then
                   down-sample to G with both outcomes kept; the pool feeds the baseline
    roc            GRPO-RoC: over-sample, then down-sample to G: failures uniformly, successes by quality

Each strategy returns the groups to train on, the groups it generated and set aside (the sampler
observes both), and its metrics under ``rollouts/``. All randomness comes from a generator seeded
by (seed, step), so a resumed run makes the same choices. ``ReplayBuffer`` (DOTS's rollout
replay) and prompt templates (prompt augmentation) work with every strategy.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlvr.data import Example
from rlvr.data.images import with_prompt_media
from rlvr.data.curricula.base import NO_ACCURACY
from rlvr.data.sampler import Sampler
from rlvr.rewards import RewardFn
from rlvr.rollout.engine import Engine
from rlvr.train.rollouts import generate_groups, has_verdict, is_correct, judged_accuracy, trained_rewards
from rlvr.types import Completion, Group, PromptMedia, Sample, SamplingParams
from rlvr.options import DynamicOptions, ReinforceAdaOptions, ReplayOptions, RocOptions



@dataclass
class Source:
    """What a strategy draws on: the sampler for prompts, the engine and rewards for groups."""

    engine: Engine
    examples: list[Example]
    prompt_ids: list[list[int]]
    rewards: list[RewardFn]
    params: SamplingParams
    sampler: Sampler
    rng: np.random.Generator
    on_error: str = "zero"
    variants: Callable[[int, int, np.random.Generator], list[list[int]]] | None = None
    """Prompt augmentation: (prompt index, n, rng) → the n prompts (token ids) its samples get."""
    episodes: Callable[[list[int], int], list[Group]] | None = None
    """Multi-turn environments: (prompt indices, n) → groups of n episodes each (env.name)."""
    rescore: Callable[[list[Group]], list[Group]] | None = None
    """Fills in rewards that need the policy (intrinsic ones) before a strategy looks at them."""
    media: list[PromptMedia | None] | None = None
    """Each prompt's images (TaskData.media), None for a text task."""
    generated: int = 0
    """Completions sampled so far this step."""
    tokens: int = 0
    """Completion tokens sampled so far this step (kept or not)."""

    @property
    def group_size(self) -> int:
        return self.params.n

    def generate(self, indices: list[int], n: int | None = None) -> list[Group]:
        """``n`` (default G) scored completions for each prompt index, with each group's accuracy."""
        n = self.params.n if n is None else n
        if not indices:
            return []
        if self.episodes is not None:
            groups = self.episodes(indices, n)
        else:
            per_sample = [self.variants(i, n, self.rng) for i in indices] if self.variants else None
            groups = generate_groups(self.engine, self.examples, self.prompt_ids, indices, self.rewards,
                                     dataclasses.replace(self.params, n=n), on_error=self.on_error,
                                     per_sample_prompts=per_sample, media=self.media)
        if self.rescore is not None:
            groups = self.rescore(groups)
        self.generated += n * len(indices)
        self.tokens += sum(len(x.completion.token_ids) for g in groups for x in g.samples)
        return [with_accuracy(g, self.primary) for g in groups]

    @property
    def primary(self) -> str:
        return self.rewards[0].name


def with_accuracy(group: Group, primary: str) -> Group:
    """The group with its accuracy over the samples that got a verdict (`judged_accuracy`): None
    when none did, and samplers then learn nothing from it (`Rollouts.observe`)."""
    return dataclasses.replace(group, accuracy=judged_accuracy(group.samples, primary))


def has_spread(group: Group) -> bool:
    """Rewards that differ among the samples the update trains on (`trained_rewards`: a sample
    without a verdict takes the others' mean there): the group carries a GRPO gradient."""
    rewards = trained_rewards(group)
    return len(rewards) > 1 and max(rewards) - min(rewards) > 1e-9


@dataclass
class Gathered:
    train: list[Group]
    aside: list[Group] = field(default_factory=list)
    """Generated but not trained on (the sampler still observes them)."""
    metrics: dict[str, float] = field(default_factory=dict)


def plain(src: Source, n: int) -> Gathered:
    """The sampler's next n prompts, G completions each."""
    return Gathered(src.generate(src.sampler.next_batch(n)))


def dynamic(src: Source, n: int, **knobs: Any) -> Gathered:
    """DAPO's dynamic sampling (Yu et al., arXiv:2503.14476, §3.2): a group whose rewards are all
    equal has zero advantage under group normalisation and teaches nothing, so it is set aside
    and more prompts are sampled until n groups with differing rewards are in hand.

    Each round asks the sampler for ceil((n − kept) × oversample) prompts; after ``max_rounds``
    rounds the step trains on the groups it has (fewer than n; DAPO keeps sampling, a bound keeps a
    step's time predictable). Groups beyond n are set aside too. Never trains on a zero-spread group.
    ``knobs``: rlvr.options.DynamicOptions.
    """
    o = DynamicOptions(**knobs)
    max_rounds, oversample = o.max_rounds, o.oversample
    kept: list[Group] = []
    aside: list[Group] = []
    rounds = 0
    while len(kept) < n and rounds < max_rounds:
        rounds += 1
        for group in src.generate(src.sampler.next_batch(math.ceil((n - len(kept)) * oversample))):
            (kept if has_spread(group) and len(kept) < n else aside).append(group)
    generated = len(kept) + len(aside)
    return Gathered(kept, aside, {
        "rollouts/rounds": float(rounds), "rollouts/groups_generated": float(generated),
        "rollouts/zero_spread_fraction": sum(not has_spread(g) for g in aside) / generated,
        "rollouts/filled_fraction": len(kept) / n})


def reinforce_ada(src: Source, n: int, **knobs: Any) -> Gathered:
    """Reinforce-Ada (Xiong et al., arXiv:2510.04996): adaptive sampling with successive
    elimination. Each of the n prompts is sampled ``round_size`` (default G) at a time; after a
    round a prompt leaves the active set once its exit rule holds, so later rounds spend the budget
    on prompts still unresolved. Exit rules:

      balanced          ≥ G//2 correct and ≥ G − G//2 incorrect samples collected
      positive-focused  ≥ ``min_positives`` correct samples collected

    Then each prompt's pool is down-sampled to G: up to G//2 correct samples (drawn at random),
    the rest incorrect, topped up from whichever side has more, so both outcomes are present
    whenever the pool has both. ``Group.pool_rewards`` keeps every reward of the pool:
    ``algo.advantage = "global_pool"`` then takes the baseline and scale from all of them, as the
    paper does. "Correct" means full marks from the first reward function. ``knobs``:
    rlvr.options.ReinforceAdaOptions.
    """
    o = ReinforceAdaOptions(**knobs)
    exit, max_rounds, min_positives = o.exit, o.max_rounds, o.min_positives
    g_size = src.group_size
    size = o.round_size or g_size
    indices = src.sampler.next_batch(n)
    pools: dict[int, list[Sample]] = {i: [] for i in indices}
    heads: dict[int, Group] = {}
    want_pos, want_neg = g_size // 2, g_size - g_size // 2

    def done(pool: list[Sample]) -> bool:
        pos, neg, _ = _sides(pool, src.primary)
        if exit == "balanced":
            return len(pos) >= want_pos and len(neg) >= want_neg
        return len(pos) >= min_positives

    active = list(dict.fromkeys(indices))
    rounds = 0
    while active and rounds < max_rounds:
        rounds += 1
        for i, group in zip(active, src.generate(active, size)):
            pools[i] += group.samples
            heads.setdefault(i, group)
        active = [i for i in active if not done(pools[i])]
    train = []
    for i in indices:
        pool = pools[i]
        pos, neg, unjudged = _sides(pool, src.primary)
        take_pos = min(len(pos), max(want_pos, g_size - len(neg)))
        chosen = _pick(src.rng, pos, take_pos) + _pick(src.rng, neg, min(len(neg), g_size - take_pos))
        chosen += _pick(src.rng, unjudged, min(len(unjudged), g_size - len(chosen)))  # only to fill the group
        order = src.rng.permutation(len(chosen))
        group = dataclasses.replace(heads[i], samples=tuple(chosen[k] for k in order),
                                    pool_rewards=_pool_rewards(pool))
        train.append(with_accuracy(group, src.primary))
    return Gathered(train, [], {
        "rollouts/rounds": float(rounds), "rollouts/samples_per_prompt": src.generated / max(len(indices), 1),
        "rollouts/unresolved_fraction": len(active) / max(len(indices), 1),
        "rollouts/zero_spread_fraction": statistics.fmean(not has_spread(g) for g in train) if train else 0.0})


def roc(src: Source, n: int, **knobs: Any) -> Gathered:
    """GRPO-RoC, Resample-on-Correct (rStar2-Agent, Shang et al., arXiv:2508.20722): sample
    ``oversample`` × G completions per prompt, then keep G. Failures are kept broadly: drawn
    uniformly at random, so the model sees the variety of its errors. Successes are kept by
    quality: the fewest penalties first (ties at random), where a sample's penalty is the sum of
    (1 − value) over the reward parts named in ``quality`` (e.g. a weight-0 "format" reward, or a
    tool-error score; none named: drawn at random like failures). The kept mix follows the pool's
    success ratio, with at least ``min_negatives`` failures and ``min_positives`` successes where
    the pool has them (the recipe's min_zero/min_non_zero_reward_trace_num). With
    ``reject_equal``, a prompt whose pool rewards are all equal is set aside. ``knobs``:
    rlvr.options.RocOptions.
    """
    o = RocOptions(**knobs)
    oversample, quality, reject_equal = o.oversample, o.quality, o.reject_equal
    min_negatives, min_positives = o.min_negatives, o.min_positives
    g_size = src.group_size
    wide = max(g_size, math.ceil(g_size * oversample))
    train, aside = [], []
    for group in src.generate(src.sampler.next_batch(n), wide):
        if reject_equal and not has_spread(group):
            aside.append(group)
            continue
        pos, neg, unjudged = _sides(list(group.samples), src.primary)
        take_pos = round(g_size * len(pos) / max(len(pos) + len(neg), 1))
        take_pos = max(take_pos, min(min_positives, len(pos)))
        take_pos = min(take_pos, g_size - min(min_negatives, len(neg)), len(pos))
        take_neg = min(len(neg), g_size - take_pos)
        take_pos = min(len(pos), g_size - take_neg)
        jitter = src.rng.random(len(pos))
        penalty = [sum(1.0 - x.reward_parts.get(q, 0.0) for q in (quality or [])) for x in pos]
        best = [pos[k] for k in sorted(range(len(pos)), key=lambda k: (penalty[k], jitter[k]))[:take_pos]]
        chosen = best + _pick(src.rng, neg, take_neg)
        chosen += _pick(src.rng, unjudged, min(len(unjudged), g_size - len(chosen)))  # only to fill the group
        order = src.rng.permutation(len(chosen))
        kept = dataclasses.replace(group, samples=tuple(chosen[k] for k in order),
                                   pool_rewards=_pool_rewards(list(group.samples)))
        train.append(with_accuracy(kept, src.primary))
    metrics = {"rollouts/rejected_fraction": len(aside) / max(n, 1)}
    rates = [g.accuracy for g in train if g.accuracy is not None]  # groups with a verdict
    if rates:
        metrics["rollouts/kept_accuracy"] = statistics.fmean(rates)
    return Gathered(train, aside, metrics)


def _pool_rewards(pool: list[Sample]) -> tuple[float, ...] | None:
    """The rewards of a pool's samples that the update would train on (not `Sample.excluded`):
    what `global_pool` takes its baseline and scale from; None when there are none (the group's
    own rewards then serve, as without a pool)."""
    return tuple(x.reward for x in pool if not x.excluded) or None


def _sides(pool: list[Sample], primary: str) -> tuple[list[Sample], list[Sample], list[Sample]]:
    """A pool's correct and wrong samples among those the correctness reward judged, and the
    samples it gave no verdict (`has_verdict`): a failed sandbox is neither side."""
    pos: list[Sample] = []
    neg: list[Sample] = []
    unjudged: list[Sample] = []
    for x in pool:
        if not has_verdict(x, primary):
            unjudged.append(x)
        elif is_correct(x, primary):
            pos.append(x)
        else:
            neg.append(x)
    return pos, neg, unjudged


def _pick(rng: np.random.Generator, items: list[Sample], k: int) -> list[Sample]:
    return [items[j] for j in sorted(rng.choice(len(items), size=k, replace=False))] if k > 0 else []


ROLLOUTS: dict[str, Callable[..., Gathered]] = {
    "plain": plain, "dynamic": dynamic, "reinforce_ada": reinforce_ada, "roc": roc}


class ReplayBuffer:
    """Rollout replay (DOTS, Sun et al., arXiv:2506.05316, §4): a FIFO buffer of recent groups
    that had differing rewards; each step takes ``fraction`` of its groups from it instead of
    sampling them. A replayed group was sampled by an older policy: its completions' sampling
    log-probs become the "old" policy of the PPO ratio, so the clipped objective is importance
    weighted (update_policy does this for groups with a ``replay_age``). Groups older
    than ``max_age`` steps are dropped, and a group is replayed at most once."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """`sampler.replay`'s keys (rlvr.options.ReplayOptions: capacity, fraction, max_age)."""
        o = ReplayOptions(*args, **kwargs)
        self.capacity, self.fraction, self.max_age = o.capacity, o.fraction, o.max_age
        self.items: list[tuple[int, Group]] = []  # (step it was sampled at, group), oldest first

    def take(self, n: int, step: int, rng: np.random.Generator) -> list[Group]:
        """Up to round(fraction × n) groups sampled at most max_age steps ago, removed from the buffer."""
        self.items = [(s, g) for s, g in self.items if step - s <= self.max_age]
        k = min(round(self.fraction * n), len(self.items), n - 1)
        if k <= 0:
            return []
        picked = sorted(rng.choice(len(self.items), size=k, replace=False).tolist())
        out = [dataclasses.replace(g, replay_age=step - s) for s, g in (self.items[j] for j in picked)]
        self.items = [item for j, item in enumerate(self.items) if j not in set(picked)]
        return out

    def add(self, groups: list[Group], step: int) -> None:
        self.items += [(step, dataclasses.replace(g, advantages=None, masked=None))
                       for g in groups if has_spread(g) and g.replay_age is None]
        self.items = self.items[-self.capacity :]

    def state_dict(self) -> dict[str, Any]:
        return {"items": [(s, _group_state(g)) for s, g in self.items]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.items = [(int(s), _group_from_state(g)) for s, g in state["items"]]

    def attach_media(self, media: list[PromptMedia | None]) -> None:
        """Give the groups read back from a checkpoint their prompts' images (`TaskData.media`, by
        prompt index): the checkpoint keeps a group's token ids, not its pixels."""
        groups = _with_media([g for _, g in self.items], media)
        self.items = [(s, g) for (s, _), g in zip(self.items, groups)]


def _with_media(groups: list[Group], media: list[PromptMedia | None]) -> list[Group]:
    """The groups with their prompts' images (`TaskData.media`, by prompt index) put back."""
    return [dataclasses.replace(g, samples=tuple(with_prompt_media(g.samples, media))) for g in groups]


def _completion_state(c: Completion) -> dict[str, Any]:
    return {"token_ids": list(c.token_ids), "logprobs": list(c.logprobs), "finish_reason": c.finish_reason,
            "text": c.text, "loss_mask": None if c.loss_mask is None else list(c.loss_mask),
            "turn_index": None if c.turn_index is None else list(c.turn_index), "policy_version": c.policy_version,
            "swapped_at": list(c.swapped_at)}


def _tuple_or_none(state: dict[str, Any], key: str) -> tuple[Any, ...] | None:
    return None if state.get(key) is None else tuple(state[key])


def _completion_from_state(x: dict[str, Any]) -> Completion:
    return Completion(tuple(x["token_ids"]), tuple(x["logprobs"]), x["finish_reason"], x["text"],
                      loss_mask=_tuple_or_none(x, "loss_mask"), turn_index=_tuple_or_none(x, "turn_index"),
                      policy_version=x.get("policy_version"), swapped_at=tuple(x.get("swapped_at", ())))


def _group_state(g: Group) -> dict[str, Any]:
    """A group as plain lists and numbers (checkpoints), every field of its samples included:
    a replayed episode must keep its loss mask and segments across a resume."""
    return {"prompt": g.prompt, "metadata": dict(g.metadata), "accuracy": g.accuracy,
            "pool_rewards": None if g.pool_rewards is None else list(g.pool_rewards), "staleness": g.staleness,
            "greedy_reward": g.greedy_reward, "replay_age": g.replay_age,
            "advantages": None if g.advantages is None else list(g.advantages),
            "masked": None if g.masked is None else list(g.masked),
            "samples": [
        {"prompt_ids": list(x.prompt_ids), **_completion_state(x.completion), "reward": x.reward,
         "reward_parts": dict(x.reward_parts), "prompt_index": x.prompt_index,
         "segments": [{"prompt_ids": list(p), **_completion_state(c)} for p, c in x.segments]} for x in g.samples]}


def _group_from_state(state: dict[str, Any]) -> Group:
    samples = tuple(Sample(tuple(x["prompt_ids"]), _completion_from_state(x), x["reward"], dict(x["reward_parts"]),
                           x["prompt_index"], segments=tuple((tuple(seg["prompt_ids"]), _completion_from_state(seg))
                                                             for seg in x.get("segments", [])))
                    for x in state["samples"])
    metadata = dict(state["metadata"])
    # checkpoints before these were Group fields kept them in the metadata
    accuracy = state["accuracy"] if "accuracy" in state else metadata.pop("accuracy", None)
    pool = state["pool_rewards"] if "pool_rewards" in state else metadata.pop("pool_rewards", None)
    staleness = int(state["staleness"] if "staleness" in state else metadata.pop("stale", 0))
    return Group(state["prompt"], samples, metadata, accuracy=accuracy, staleness=staleness,
                 pool_rewards=None if pool is None else tuple(pool), greedy_reward=state.get("greedy_reward"),
                 replay_age=state.get("replay_age"), advantages=_tuple_or_none(state, "advantages"),
                 masked=_tuple_or_none(state, "masked"))


@dataclass
class Collected:
    """A step's rollouts, as the rollout strategy gathered them."""

    gathered: Gathered
    replayed: list[Group]
    tokens: int
    """Completion tokens sampled (kept or not)."""
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    """What the collection itself reports beyond the strategy's (asynchronous rollouts: staleness)."""

    @property
    def groups(self) -> list[Group]:
        """What the step trains on: the new groups, then the replayed ones."""
        return self.gathered.train + self.replayed

    def state(self) -> dict[str, Any]:
        """As plain lists and numbers (a checkpoint of asynchronous rollouts keeps the collections
        made ahead of it)."""
        g = self.gathered
        return {"train": [_group_state(x) for x in g.train], "aside": [_group_state(x) for x in g.aside],
                "gathered_metrics": dict(g.metrics), "replayed": [_group_state(x) for x in self.replayed],
                "tokens": self.tokens, "seconds": self.seconds, "metrics": dict(self.metrics)}

    @staticmethod
    def from_state(x: dict[str, Any]) -> Collected:
        gathered = Gathered([_group_from_state(g) for g in x["train"]], [_group_from_state(g) for g in x["aside"]],
                            dict(x["gathered_metrics"]))
        return Collected(gathered, [_group_from_state(g) for g in x["replayed"]], int(x["tokens"]),
                         float(x["seconds"]), dict(x["metrics"]))

    def with_media(self, media: list[PromptMedia | None]) -> Collected:
        g = self.gathered
        return dataclasses.replace(self, gathered=Gathered(_with_media(g.train, media), _with_media(g.aside, media),
                                                           g.metrics), replayed=_with_media(self.replayed, media))


class Rollouts:
    """Collects each step's groups (replayed ones first taken from the buffer, then fresh ones by
    the configured strategy), and lets the sampler observe them and the buffer keep them. Here
    the collection runs when the step asks for it; rlvr.scaleout.pipeline runs it ahead."""

    def __init__(self, sampler: Sampler, replay: ReplayBuffer | None) -> None:
        self.sampler, self.replay = sampler, replay
        self.pending: list[Observation] = []
        """Observations a checkpoint of asynchronous rollouts carried, not made yet (one written by
        rlvr 0.2.0 before the checkpoints kept the collections made ahead): the steps before it
        whose groups the sampler had not seen when the next collection began. An asynchronous run
        makes them between its collections as the run it resumes did; a synchronous one before
        its first."""
        self.ahead: dict[int, Collected] = {}
        """Collections a checkpoint of asynchronous rollouts carried, by step: made before it for
        the steps after it (rlvr.scaleout.pipeline), trained as they were made."""

    def take(self, step: int, make: Callable[[int], Collected]) -> Collected:
        """Step's rollouts: made already where a checkpoint carried them (`ahead`), else by
        ``make(step)`` (rlvr.train.run.collect)."""
        for observation in self.pending:
            self.observe(observation.own, observation.aside, observation.step)
        self.pending = []
        return self.ahead.pop(step) if step in self.ahead else make(step)

    def observe(self, own: list[Group], aside: list[Group], step: int) -> None:
        """The sampler learns from every group generated this step (set-aside ones have zero
        advantage); the replay buffer keeps the fresh ones."""
        aside = [g if g.advantages is not None else dataclasses.replace(g, advantages=(0.0,) * len(g.samples))
                 for g in aside]
        unset = [g for g in own + aside if g.accuracy is None and not all(x.excluded for x in g.samples)]
        if unset:  # a collection path that forgot `with_accuracy`, not a group without a verdict
            raise ValueError(f"{NO_ACCURACY}: {unset[0].prompt[:60]!r}")
        # a group without a verdict (its reward's service down, say) says nothing about the prompt
        self.sampler.observe([g for g in own + aside if g.accuracy is not None])
        if self.replay is not None:
            self.replay.add(own, step)

    def metrics(self, replayed: list[Group]) -> dict[str, float]:
        out: dict[str, float] = {"epoch": float(self.sampler.epoch)}
        out |= {f"sampler/{k}": float(v) for k, v in self.sampler.metrics().items()}
        if self.replay is not None:
            out["replay/groups"] = float(len(replayed))
            out["replay/age_mean"] = statistics.fmean(g.replay_age or 0 for g in replayed) if replayed else 0.0
            out["replay/buffer_size"] = float(len(self.replay.items))
        return out

    def drain(self) -> None:
        """Wait for work under way (nothing here); before a checkpoint or an evaluation."""

    def close(self) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(),
                **({"replay": self.replay.state_dict()} if self.replay is not None else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])
        if self.replay is not None and "replay" in state:
            self.replay.load_state_dict(state["replay"])
        self.pending = [Observation.from_state(x) for x in state.get("pending_observations", [])]
        self.ahead = {int(step): Collected.from_state(x) for step, x in state.get("ahead", {}).items()}

    def attach_media(self, media: list[PromptMedia | None]) -> None:
        """Give the groups read back from a checkpoint (replay, pending observations, collections
        made ahead) their prompts' images (`TaskData.media`, by prompt index)."""
        if self.replay is not None:
            self.replay.attach_media(media)
        self.pending = [x.with_media(media) for x in self.pending]
        self.ahead = {step: made.with_media(media) for step, made in self.ahead.items()}


@dataclass(frozen=True)
class Observation:
    """One step's `Rollouts.observe`: its trained groups and those set aside; ``after``, the
    collection it was queued behind (asynchronous rollouts)."""

    after: int
    step: int
    own: list[Group]
    aside: list[Group]

    def state(self) -> dict[str, Any]:
        return {"after": self.after, "step": self.step, "own": [_group_state(g) for g in self.own],
                "aside": [_group_state(g) for g in self.aside]}

    @staticmethod
    def from_state(x: dict[str, Any]) -> Observation:
        return Observation(int(x["after"]), int(x["step"]), [_group_from_state(g) for g in x["own"]],
                           [_group_from_state(g) for g in x["aside"]])

    def with_media(self, media: list[PromptMedia | None]) -> Observation:
        return dataclasses.replace(self, own=_with_media(self.own, media), aside=_with_media(self.aside, media))


