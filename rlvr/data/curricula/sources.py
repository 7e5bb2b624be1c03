"""Curricula over sources and categories: uniform, a weighted mixture, DUMP's UCB and SEC's
TD(0) bandits."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

import numpy as np

from rlvr.data.curricula.base import (
    SamplerContext,
    _by_source,
    _mean_abs_advantage,
    _prompt,
    _rng,
    _softmax,
    _SourceOrders,
)
from rlvr.data.sampler import UniformSampler
from rlvr.types import Group


class UniformCurriculum:
    """`UniformSampler` (every prompt once per epoch, reshuffled from (seed, epoch)) built from a
    SamplerContext. It ignores outcomes."""

    def __init__(self, ctx: SamplerContext) -> None:
        self.inner = UniformSampler(len(ctx.texts), ctx.seed)

    def next_batch(self, n: int) -> list[int]:
        return self.inner.next_batch(n)

    def observe(self, groups: list[Group]) -> None:
        """Uniform sampling ignores outcomes."""

    def metrics(self) -> dict[str, float]:
        return {}

    @property
    def epoch(self) -> float:
        return self.inner.epoch

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)


class WeightedSampler:
    """A fixed mixture of sources: each draw's source follows `weights`, and the prompt is the
    next in that source's own order (every prompt of the source once per pass, reshuffled each
    pass). Sources left out of `weights` are never drawn.

    weights: {source: weight}, weights ≥ 0, normalised to sum 1 (required)."""

    def __init__(self, ctx: SamplerContext, *, weights: dict[str, float] | None = None) -> None:
        self.orders = _SourceOrders(ctx.sources, ctx.seed)
        known = ", ".join(repr(s) for s in self.orders.names)
        if not weights:
            raise ValueError(f"sampler 'weighted' needs weights = {{source: weight}}; the sources are {known}")
        for s, w in weights.items():
            if s not in self.orders.members:
                raise ValueError(f"sampler 'weighted': unknown source {s!r} in weights; the sources are {known}")
            if not w >= 0:
                raise ValueError(f"sampler 'weighted': weight of {s!r} must be ≥ 0 (got {w})")
        w_S = np.array([float(weights.get(s, 0.0)) for s in self.orders.names])
        if w_S.sum() <= 0:
            raise ValueError("sampler 'weighted': the weights sum to 0")
        self.probs_S = w_S / w_S.sum()
        self.num_prompts, self.seed, self.calls, self.drawn = len(ctx.texts), ctx.seed, 0, 0

    def next_batch(self, n: int) -> list[int]:
        out = self.orders.mixture(_rng(self.seed, "weighted", self.calls), self.probs_S, n)
        self.calls, self.drawn = self.calls + 1, self.drawn + n
        return out

    def observe(self, groups: list[Group]) -> None:
        """A fixed mixture ignores outcomes."""

    def metrics(self) -> dict[str, float]:
        return {f"p/{s}": float(p) for s, p in zip(self.orders.names, self.probs_S)}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "positions": dict(self.orders.positions)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.orders.positions = {s: int(state["positions"][s]) for s in self.orders.names}


class DUMPSampler:
    """DUMP (Wang et al., "DUMP: Automated Distribution-Level Curriculum Learning for RL-based
    LLM Post-training", arXiv:2504.09710): each source is a bandit arm whose learnability is
    the expected absolute advantage of its recent groups; a UCB score adds an exploration bonus
    and a softmax turns scores into the probability of drawing from each source:
        score_j = mean(window_j) + c·sqrt(2·ln N / n_j),    P(j) = softmax_j(score_j / τ),
    window_j = the mean |advantage| of each of source j's last `window` observed groups,
    n_j = groups of source j observed so far, N = Σ_j n_j. A source never observed has an
    infinite score: while there are such sources, draws are uniform over them. The prompt of
    each draw is the next in its source's own reshuffled-per-pass order.

    Defaults from the paper's code (window 300, τ = 0.1, c = 1). Choice: "draws" n_j count
    observed groups (what the window learns from), and the bonus uses ln N and n_j rather than
    the code's ln(N + 1) and n_j + 1, with the unvisited case handled as infinite."""

    def __init__(self, ctx: SamplerContext, *, window: int = 300, c: float = 1.0, temperature: float = 0.1) -> None:
        if window < 1 or c < 0 or temperature <= 0:
            raise ValueError("sampler 'dump': need window ≥ 1, c ≥ 0, temperature > 0")
        self.orders = _SourceOrders(ctx.sources, ctx.seed)
        self.sources, self.window, self.c, self.temperature = ctx.sources, window, c, temperature
        self.windows: dict[str, deque[float]] = {s: deque(maxlen=window) for s in self.orders.names}
        self.counts = dict.fromkeys(self.orders.names, 0)
        self.num_prompts, self.seed, self.calls, self.drawn = len(ctx.texts), ctx.seed, 0, 0

    def scores(self) -> dict[str, float]:
        total = sum(self.counts.values())
        return {s: math.inf if self.counts[s] == 0 else float(np.mean(self.windows[s]))
                + self.c * math.sqrt(2 * math.log(total) / self.counts[s]) for s in self.orders.names}

    def probabilities(self) -> dict[str, float]:
        score_S = np.array(list(self.scores().values()))
        unvisited = np.isinf(score_S)
        p_S = unvisited / unvisited.sum() if unvisited.any() else _softmax(score_S, self.temperature)
        return dict(zip(self.orders.names, (float(p) for p in p_S)))

    def next_batch(self, n: int) -> list[int]:
        p_S = np.array(list(self.probabilities().values()))
        out = self.orders.mixture(_rng(self.seed, "dump", self.calls), p_S, n)
        self.calls, self.drawn = self.calls + 1, self.drawn + n
        return out

    def observe(self, groups: list[Group]) -> None:
        for g in groups:
            if g.samples:
                s = self.sources[_prompt(g)]
                self.windows[s].append(_mean_abs_advantage(g))
                self.counts[s] += 1

    def metrics(self) -> dict[str, float]:
        return {f"p/{s}": p for s, p in self.probabilities().items()}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "positions": dict(self.orders.positions),
                "windows": {s: list(w) for s, w in self.windows.items()}, "counts": dict(self.counts)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.orders.positions = {s: int(state["positions"][s]) for s in self.orders.names}
        self.windows = {s: deque((float(x) for x in state["windows"][s]), maxlen=self.window)
                        for s in self.orders.names}
        self.counts = {s: int(state["counts"][s]) for s in self.orders.names}


class SECSampler:
    """Self-Evolving Curriculum (Chen et al., "Self-Evolving Curriculum for LLM Reasoning",
    arXiv:2505.14970): categories (here: sources) are arms of a non-stationary bandit whose
    reward is the mean absolute advantage of the category's groups in a step, a proxy for the
    immediate learning gain. After each step, for every category c with groups in it,
        Q_c ← α·r_c + (1 − α)·Q_c      (TD(0) toward r_c = mean over its groups of mean |advantage|),
    and each draw's category is sampled by Boltzmann exploration, P(c) = softmax_c(Q_c / τ);
    the prompt is the next in the category's own reshuffled-per-pass order. Q starts at 0 for
    every category.

    Choices (α and τ are not verified against the paper): α = 0.5; τ = 0.2, because r lies in
    [0, 1] for binary rewards with std-normalised advantages (2·sqrt(p(1 − p)) at success rate p),
    and τ = 0.2 lets a fully learnable category be drawn up to e⁵ ≈ 150 times as often as a
    solved one (τ = 1 would allow only e ≈ 2.7)."""

    def __init__(self, ctx: SamplerContext, *, alpha: float = 0.5, temperature: float = 0.2) -> None:
        if not 0 < alpha <= 1 or temperature <= 0:
            raise ValueError("sampler 'sec': need 0 < alpha ≤ 1, temperature > 0")
        self.orders = _SourceOrders(ctx.sources, ctx.seed)
        self.sources, self.alpha, self.temperature = ctx.sources, alpha, temperature
        self.q = dict.fromkeys(self.orders.names, 0.0)
        self.num_prompts, self.seed, self.calls, self.drawn = len(ctx.texts), ctx.seed, 0, 0

    def probabilities(self) -> dict[str, float]:
        p_S = _softmax(np.array(list(self.q.values())), self.temperature)
        return dict(zip(self.orders.names, (float(p) for p in p_S)))

    def next_batch(self, n: int) -> list[int]:
        p_S = np.array(list(self.probabilities().values()))
        out = self.orders.mixture(_rng(self.seed, "sec", self.calls), p_S, n)
        self.calls, self.drawn = self.calls + 1, self.drawn + n
        return out

    def observe(self, groups: list[Group]) -> None:
        for c, rewards in _by_source(groups, self.sources).items():
            self.q[c] = self.alpha * float(np.mean(rewards)) + (1 - self.alpha) * self.q[c]

    def metrics(self) -> dict[str, float]:
        return {**{f"p/{c}": p for c, p in self.probabilities().items()}, **{f"q/{c}": q for c, q in self.q.items()}}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "positions": dict(self.orders.positions), "q": dict(self.q)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.orders.positions = {s: int(state["positions"][s]) for s in self.orders.names}
        self.q = {c: float(state["q"][c]) for c in self.orders.names}
