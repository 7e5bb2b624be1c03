"""The data that flows through a step: completions from the engine, scored samples, groups.

Shape suffixes used across rlvr: `_B` batch (sequences), `_G` group, `_P` prompts, `_T` tokens,
`_V` vocabulary, `_N` flattened selected tokens. `logprobs_BT[b, t]` is the log-probability of
token `t` of sequence `b` given the tokens before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    import torch

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """How the engine samples. temperature = 0 means greedy decoding."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    n: int = 1
    """Completions per prompt (the group size G)."""

    def __post_init__(self) -> None:
        checks = {"temperature >= 0": self.temperature >= 0, "0 < top_p <= 1": 0 < self.top_p <= 1,
                  "top_k >= 0": self.top_k >= 0, "max_new_tokens >= 1": self.max_new_tokens >= 1, "n >= 1": self.n >= 1}
        broken = [rule for rule, ok in checks.items() if not ok]
        if broken:
            raise ValueError(f"sampling parameters: need {', '.join(broken)} (got {self})")


@dataclass(frozen=True)
class Completion:
    """One sampled completion, exactly as the engine produced it."""

    token_ids: tuple[int, ...]
    """Completion token ids as sampled (never decoded and re-encoded)."""
    logprobs: tuple[float, ...]
    """Log-probability of each sampled token under the distribution it was sampled from
    (after temperature, top-k and top-p)."""
    finish_reason: FinishReason
    text: str
    """The decoded completion, for rewards and logs."""
    loss_mask: tuple[int, ...] | None = None
    """1 where a token was sampled by the policy and is trained on, 0 where it was injected (a
    tool's output, an environment's observation) and only conditions what follows. None = every
    token sampled. Set in one place: the episode runner (rlvr.agents)."""
    turn_index: tuple[int, ...] | None = None
    """For an episode: the turn each token belongs to (0-based; an observation belongs to the turn
    whose action it answers, a summary to the action after it), for turn-level credit. None for a
    single completion."""
    policy_version: int | None = None
    """The version of the weights that sampled it (rollout workers count updates); None from a
    local engine, which always samples the current policy. With partial rollouts, the version
    that sampled its first token: the oldest, which its staleness counts from."""
    swapped_at: tuple[int, ...] = ()
    """Partial rollouts: the token indices at which newer weights took over mid-sample (each
    token's log-prob is from the weights that sampled it)."""

    def trainable(self) -> int:
        """How many tokens the loss sees."""
        return len(self.token_ids) if self.loss_mask is None else sum(self.loss_mask)


def joined_versions(parts: list[tuple[int, Completion]]) -> dict[str, Any]:
    """The `policy_version` and `swapped_at` of a completion joined from ``parts``, each the
    offset its tokens start at in the whole and the completion sampled there (an episode's
    turns): the oldest version, which its staleness counts from (None if any part has none: a
    local engine), and the offsets where newer weights took over, between or within parts. A
    part records only its first version and where it swapped, so a part that starts on a newer
    version than the previous one started on counts as a swap only past one version per swap
    of the previous parts (two updates between two tokens of one part would hide one)."""
    versions = [c.policy_version for _, c in parts]
    if not parts or None in versions:
        return {"policy_version": None, "swapped_at": ()}
    swaps: list[int] = []
    latest = -1  # the newest version known to have sampled a token so far
    for offset, c in parts:
        assert c.policy_version is not None
        if latest >= 0 and c.policy_version > latest:
            swaps.append(offset)
        # each swap within a part is to weights at least one version newer
        latest = max(latest, c.policy_version + len(c.swapped_at))
        swaps += [offset + i for i in c.swapped_at]
    return {"policy_version": min(v for v in versions if v is not None), "swapped_at": tuple(swaps)}


@dataclass(frozen=True, eq=False)
class PromptMedia:
    """The images of a prompt for a vision-language model, in two forms: the images themselves
    (PIL, what vLLM's multimodal inputs take) and the pixel inputs the processor made of them
    (``pixel_values``, and e.g. ``image_grid_thw``; batch of one prompt), what a Hugging Face
    forward takes beside the prompt's ids, whose image tokens they fill.

    Compared by identity (``eq=False``): the G samples of a prompt hold the same object, and two
    prompts with the same text but different images are different prompts. `prompt_media` makes
    one from what a processor returned."""

    images: tuple[Any, ...]
    inputs: Mapping[str, torch.Tensor]
    tokens: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Per-token inputs over the prompt's ids (1-D, the prompt's length; e.g. Qwen2-VL's
    ``mm_token_type_ids``), zero-padded with each row where a batch is made."""
    template_ids: tuple[int, ...] = ()
    """The prompt's ids as its chat template wrote them, one placeholder token per image, before
    the processor expanded each into the image's tokens: what vLLM takes (its own processor
    expands them, and would expand already expanded ids again). Empty where not known."""


@dataclass(frozen=True)
class Sample:
    """A completion of one prompt, scored."""

    prompt_ids: tuple[int, ...]
    completion: Completion
    reward: float
    """Weighted total of the reward functions."""
    reward_parts: dict[str, float]
    """Each reward function's raw value, by name."""
    prompt_index: int
    """Index of the prompt in its source (for logs and samplers)."""
    off_policy: bool = False
    """An expert demonstration mixed into its group (``expert.mode = "luffy"``), not sampled by
    the policy; its ``completion.logprobs`` are 0 (the expert's probability taken as 1)."""
    segments: tuple[tuple[tuple[int, ...], Completion], ...] = ()
    """Earlier segments of an episode whose context was summarised (SUPO), as (prompt_ids,
    completion) pairs in order; ``prompt_ids``/``completion`` above are the last segment. Every
    segment is trained with this sample's advantage."""
    media: PromptMedia | None = None
    """The prompt's images (a vision-language model's prompt); None for text."""

    @property
    def prompt_key(self) -> tuple[tuple[int, ...], PromptMedia | None]:
        """What makes two samples' prompts the same: their ids and their images."""
        return self.prompt_ids, self.media

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion.token_ids)

    @property
    def sampled_tokens(self) -> int:
        """Tokens the policy sampled: the completion's and its earlier segments', never the
        observations an environment injected (loss mask 0). What length shaping counts."""
        return self.completion.trainable() + sum(c.trainable() for _, c in self.segments)

    @property
    def excluded(self) -> bool:
        """A reward function returned None ("no verdict"): the sample stays out of the update."""
        return any(k.endswith("/excluded") for k in self.reward_parts)


@dataclass(frozen=True)
class Group:
    """The G samples of one prompt, with the prompt text."""

    prompt: str
    samples: tuple[Sample, ...]
    metadata: dict[str, Any] = field(default_factory=dict)
    """What the group was made with: the prompt's id, and for episodes the runner's record (each
    episode's texts, ending, turn rewards, metrics, injected spans). Never written afterwards:
    what later stages derive is a field below, set on a new Group (`dataclasses.replace`)."""
    accuracy: float | None = None
    """Share of the samples the first (correctness) reward gave full marks (collection)."""
    pool_rewards: tuple[float, ...] | None = None
    """Every reward generated for the prompt, when a rollout strategy chose the group from a larger
    pool (None: the group is its own pool)."""
    greedy_reward: float | None = None
    """The reward of the prompt's greedy completion (ReMax's baseline)."""
    replay_age: int | None = None
    """Steps since the group was sampled, when it was replayed from the buffer (None: fresh)."""
    staleness: int = 0
    """How many weight versions the update is ahead of the oldest policy that sampled the group
    (asynchronous rollouts)."""
    advantages: tuple[float, ...] | None = None
    """Each sample's advantage in the update (its token mean; `UpdateResult.outcomes`)."""
    masked: tuple[str | None, ...] | None = None
    """Why a sample had loss mask 0 in the update ("excluded", "truncated"), or None."""

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]


def oldest_version(samples: Sequence[Sample]) -> int | None:
    """The oldest weights' version among ``samples``, earlier segments of an episode included
    (what their staleness counts from), or None when none has one. Samples without a version
    were not sampled by a versioned engine (a demonstration, an episode the agent ended before
    sampling) and do not count."""
    completions = [c for x in samples for c in (x.completion, *(c for _, c in x.segments))]
    versions = [c.policy_version for c in completions if c.policy_version is not None]
    return min(versions) if versions else None
