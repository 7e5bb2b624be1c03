"""Per-sample values behind the loss inputs that come from a step's groups rather than the model.

The update repeats each over its sample's completion tokens and the micro-batch's `LossInputs`
(rlvr.algos.inputs) carries them: every loss sees the same record, and reads what it needs.
(An advantage estimator's inputs arrive as one record too: rlvr.train.advantages.advantage_inputs.)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rlvr.train.rollouts import is_correct, judged_accuracy
from rlvr.types import Completion, Group, Sample


@dataclass(frozen=True)
class SampleFields:
    """Per trained row, a 1-D float tensor over its completion tokens (LossInputs' fields of the same names)."""

    correct: list[torch.Tensor]
    """1 where the sample's correctness reward (its first) gave full marks (NFT)."""
    group_accuracy: list[torch.Tensor]
    """The share of correct samples among those its group's correctness reward judged (NFT)."""
    offpolicy: list[torch.Tensor]
    """1 on an expert demonstration mixed into its group (LUFFY)."""
    kl_scale: list[torch.Tensor] | None = None
    """A factor on the KL term per token, where the episodes' environment weights it by turn
    (`kl_turn_scale`, in a group's metadata: e.g. self-correction's first attempt); None: 1."""


def sample_fields(groups: list[Group], samples: list[Sample], owner: list[int]) -> SampleFields:
    """The `SampleFields` of the trained rows ``samples``, whose ``owner`` is the group sample
    (in order over ``groups``) each belongs to."""
    correct = [[float(is_correct(x, next(iter(x.reward_parts), ""))) for x in g.samples] for g in groups]
    # a group's rate over the samples its correctness reward judged (a sample without a verdict
    # trains on nothing; a group with none trains on nothing at all)
    rates = [judged_accuracy(g.samples, next(iter(g.samples[0].reward_parts), "")) or 0.0 for g in groups]
    per_sample = ([c for row in correct for c in row], [rate for row, rate in zip(correct, rates) for _ in row])

    def rows(values: list[float]) -> list[torch.Tensor]:
        return [torch.full((len(x.completion.token_ids),), values[owner[u]]) for u, x in enumerate(samples)]

    scales = [scale for g in groups for scale in g.metadata.get("kl_turn_scale", [None] * len(g.samples))]
    kl_scale = None
    if any(scale is not None for scale in scales):
        kl_scale = [turn_scale(x.completion, scales[owner[u]] or (1.0,)) for u, x in enumerate(samples)]
    return SampleFields(correct=rows(per_sample[0]), group_accuracy=rows(per_sample[1]),
                        offpolicy=[torch.full((len(x.completion.token_ids),), float(x.off_policy)) for x in samples],
                        kl_scale=kl_scale)


def turn_scale(completion: Completion, scale: Sequence[float]) -> torch.Tensor:
    """A per-turn factor on each of a completion's tokens: ``scale[t]`` for a token of turn t
    (``Completion.turn_index``; a single-turn completion is turn 0), the last entry past its end."""
    turns = completion.turn_index or (0,) * len(completion.token_ids)
    return torch.tensor([scale[min(t, len(scale) - 1)] for t in turns], dtype=torch.float32)
