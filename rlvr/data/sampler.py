"""Which prompts each step trains on. A sampler has `next_batch(n)`, `observe(groups)`, the
epoch it is in, its metrics (logged as sampler/<key>), and a state dict saved in checkpoints, so
that a resumed run sees exactly the prompts it would have."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from rlvr.types import Group


class Sampler(Protocol):
    def next_batch(self, n: int) -> list[int]: ...
    def observe(self, groups: list[Group]) -> None: ...
    def metrics(self) -> dict[str, float]: ...
    @property
    def epoch(self) -> float: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class UniformSampler:
    """Every prompt once per epoch, in an order reshuffled each epoch from (seed, epoch)."""

    def __init__(self, num_prompts: int, seed: int = 0) -> None:
        if num_prompts < 1:
            raise ValueError("the sampler needs at least one prompt")
        self.num_prompts, self.seed, self.position = num_prompts, seed, 0

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts)

    def next_batch(self, n: int) -> list[int]:
        out = []
        for k in range(self.position, self.position + n):
            epoch, i = divmod(k, self.num_prompts)
            out.append(int(self._order(epoch)[i]))
        self.position += n
        return out

    def observe(self, groups: list[Group]) -> None:
        """Uniform sampling ignores outcomes."""

    def metrics(self) -> dict[str, float]:
        return {}

    @property
    def epoch(self) -> float:
        return self.position / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])
