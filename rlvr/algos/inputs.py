"""The one record a policy loss and an off-policy correction read: a micro-batch's per-token inputs.

The training loop builds a `LossInputs` for every micro-batch and hands the same record to the
policy loss (rlvr.algos.LOSSES), the off-policy correction (rlvr.algos.CORRECTIONS) and the
KL and entropy terms. A function reads the fields it needs; none is passed by parameter name.
A loss that keeps values across optimizer steps (R²VPO's dual variable) is a `StatefulLoss`.

Shapes: ``_B`` rows, ``_T`` completion tokens; every tensor is [B, T].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import Tensor


@dataclass(frozen=True)
class LossInputs:
    """One micro-batch's per-token inputs. The first four are always set; the loop sets every
    other tensor too (a test may leave out what the function under test does not read)."""

    logprobs: Tensor
    """log π_θ of the sampled tokens, with gradient."""
    old: Tensor
    """log π_old, the log-probs the PPO ratio is taken against (detached)."""
    advantages: Tensor
    mask: Tensor
    """True on the tokens the loss trains."""
    sampler: Tensor | None = None
    """The engine's log-probs μ of what it sampled (an expert demonstration's: its π_old)."""
    ref: Tensor | None = None
    """The reference policy's log-probs, when a KL to it is in the loss."""
    kl_scale: Tensor | None = None
    """A factor on the KL term per token (an environment's `kl_turn_scale`, by the token's turn); None: 1."""
    entropy: Tensor | None = None
    """The policy's entropy at each token, with gradient."""
    correct: Tensor | None = None
    """1 on every token of a sample its correctness reward (the first) gave full marks (NFT)."""
    group_accuracy: Tensor | None = None
    """The share of correct samples in the sample's group, on every token (NFT)."""
    offpolicy: Tensor | None = None
    """1 on the tokens of an expert demonstration mixed into its group (LUFFY)."""
    state: dict[str, float] = field(default_factory=dict)
    """What a `StatefulLoss` keeps across optimizer steps (saved in checkpoints)."""

    def need(self, name: str) -> Tensor:
        """The tensor field `name`, or a ValueError saying it was not given."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"LossInputs.{name} is not set, and this function reads it")
        return value


@runtime_checkable
class StatefulLoss(Protocol):
    """A policy loss that keeps values in ``LossInputs.state`` across optimizer steps: after each
    step the update calls `after_step` with the state, the step's token-mean metrics and the
    loss's own keyword options (rlvr.train.update)."""

    def __call__(self, x: LossInputs, **knobs: Any) -> tuple[Tensor, dict[str, Tensor]]: ...

    def after_step(self, state: dict[str, float], means: dict[str, float], **knobs: Any) -> None: ...
