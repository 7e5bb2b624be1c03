"""Prompt-selection samplers ("curricula") behind the `Sampler` seam of rlvr.data.sampler.

    uniform      every prompt once per epoch (rlvr.data.sampler.UniformSampler)
    weighted     a fixed mixture of sources, each in its own reshuffled order
    prioritized  P(i) ∝ 1 − success rate (Kimi k1.5)
    schedule     fixed easy→hard stages over a known difficulty
    mopps        per-prompt discounted Beta posteriors, Thompson-sampled toward a target rate (MoPPS)
    dots         success rates predicted from similar reference prompts, closest to a target (DOTS)
    pcl          a value model's predicted success, closest to a target (PCL)
    dump         sources as UCB bandit arms scored by mean |advantage| (DUMP)
    sec          categories as TD(0) bandit arms scored by mean |advantage| (SEC)

Each is built as ``cls(ctx, **kwargs)`` from a `SamplerContext` (through `build_sampler`) and has,
besides the seam's ``next_batch(n)``, ``observe(groups)``, ``state_dict()`` and
``load_state_dict()``, a ``metrics()`` dict (logged as ``sampler/<name>``) and an ``epoch``
(prompts drawn / number of prompts).

What a sampler learns from: ``observe`` gets each step's groups after the update. A group's prompt
is ``g.samples[0].prompt_index``, its outcome ``g.metadata["accuracy"]`` (share of correct
samples) and ``g.metadata["advantages"]`` (one per sample). Groups of prompts a sampler did not
choose are used like any other.

Determinism: call k of ``next_batch`` draws from ``numpy.random.default_rng([seed, tag, k])``
(tag = a hash of the sampler's name), and k is in the state dict with everything the choices
depend on, as plain lists, dicts and numbers. A fresh instance loaded with ``state_dict()`` and fed
the same observations therefore makes the same choices.

Duplicates within one batch: none while n ≤ the number of prompts it draws from, except that the
source-mixture samplers (weighted, dump, sec) can repeat a prompt when one batch asks a source for
more prompts than it holds or crosses the end of a pass over it. mopps, dots, pcl and prioritized
also avoid prompts chosen by an earlier call since the last ``observe`` (a strategy that asks
for more prompts within a step) while enough others remain.
"""

from __future__ import annotations

import difflib
import math
import zlib
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from rlvr.algos.registry import check_keywords
from rlvr.data.sampler import Sampler, UniformSampler
from rlvr.types import Group


@dataclass(frozen=True)
class SamplerContext:
    """What the loop tells a sampler about the prompts."""

    texts: list[str]
    """Prompt texts; list position = prompt index."""
    sources: list[str]
    """Each prompt's source or category (e.g. the reasoning-gym task; "default" for one source)."""
    seed: int
    difficulty: list[float] | None = None
    """Known difficulty of each prompt, higher = harder (for "schedule")."""

    def __post_init__(self) -> None:
        if not self.texts:
            raise ValueError("a sampler needs at least one prompt")
        if len(self.sources) != len(self.texts):
            raise ValueError(f"{len(self.texts)} prompts but {len(self.sources)} sources")
        if self.difficulty is not None and len(self.difficulty) != len(self.texts):
            raise ValueError(f"{len(self.texts)} prompts but {len(self.difficulty)} difficulties")


class Curriculum(Sampler, Protocol):
    """A Sampler that also reports metrics (logged as sampler/<key>) and its epoch."""

    def metrics(self) -> dict[str, float]: ...
    @property
    def epoch(self) -> float: ...


# ---------------------------------------------------------------------------------------------
# shared pieces


def _rng(seed: int, tag: str, counter: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(tag.encode()), counter])


def _prompt(g: Group) -> int:
    return g.samples[0].prompt_index


def _mean_abs_advantage(g: Group) -> float:
    advantages = g.metadata["advantages"]
    return float(np.mean(np.abs(advantages))) if len(advantages) else 0.0


def _softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(x, dtype=np.float64) / temperature
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _draw(rng: np.random.Generator, pool: np.ndarray, n: int, p: np.ndarray | None = None) -> list[int]:
    """n entries of `pool`, distinct while n ≤ len(pool) (weighted by p if given); beyond that,
    whole further rounds."""
    out: list[int] = []
    while len(out) < n:
        k = min(n - len(out), len(pool))
        out += [int(i) for i in rng.choice(pool, size=k, replace=False, p=p)]
    return out


def _allowed(num: int, pending: Iterable[int], need: int) -> np.ndarray:
    """Prompt indices without those chosen since the last observe, unless fewer than `need` remain."""
    rest = np.setdiff1d(np.arange(num), np.fromiter(pending, dtype=np.int64))
    return rest if len(rest) >= need else np.arange(num)


def _closest(rng: np.random.Generator, pool: np.ndarray, values: np.ndarray, target: float, n: int) -> list[int]:
    """The n entries of `pool` whose values are closest to target, ties broken at random
    (repeating the ranking when n > len(pool))."""
    order = np.lexsort((rng.random(len(pool)), np.abs(values - target)))
    return [int(pool[order[k % len(pool)]]) for k in range(n)]


class _SourceOrders:
    """Each source's prompts in an order reshuffled every pass over that source, from
    (seed, source, pass). Sources keep their order of first appearance."""

    def __init__(self, sources: Sequence[str], seed: int) -> None:
        self.names = list(dict.fromkeys(sources))
        self.members = {s: np.array([i for i, x in enumerate(sources) if x == s]) for s in self.names}
        self.positions = dict.fromkeys(self.names, 0)
        self.seed = seed
        self._cache: dict[str, tuple[int, np.ndarray]] = {}

    def next(self, source: str) -> int:
        members = self.members[source]
        epoch, i = divmod(self.positions[source], len(members))
        if self._cache.get(source, (-1,))[0] != epoch:
            order = np.random.default_rng([self.seed, zlib.crc32(source.encode()), epoch]).permutation(len(members))
            self._cache[source] = (epoch, order)
        self.positions[source] += 1
        return int(members[self._cache[source][1][i]])

    def mixture(self, rng: np.random.Generator, probs_S: np.ndarray, n: int) -> list[int]:
        """n prompts: each draw's source from probs_S, the prompt next in that source's order."""
        return [self.next(self.names[j]) for j in rng.choice(len(self.names), size=n, p=probs_S)]


def _by_source(groups: list[Group], sources: list[str]) -> dict[str, list[float]]:
    """Mean |advantage| of each group, by the source of its prompt."""
    out: dict[str, list[float]] = {}
    for g in groups:
        if g.samples:
            out.setdefault(sources[_prompt(g)], []).append(_mean_abs_advantage(g))
    return out


def text_features(texts: Sequence[str], dim: int = 1024, n: int = 3) -> np.ndarray:
    """TF-IDF vectors of hashed character n-grams, L2-normalised: shape (len(texts), dim), float32.

    Text is lower-cased with runs of whitespace collapsed; each character n-gram goes to bucket
    crc32(n-gram) mod dim (deterministic across processes, unlike ``hash``). tf = log(1 + count),
    idf = log((1 + P) / (1 + df)) + 1 over the P texts given, so n-grams shared by every prompt
    (a task's template) count least. Cosine similarity is then a dot product."""
    counts_PD = np.zeros((len(texts), dim), dtype=np.float32)
    for row, text in enumerate(texts):
        t = " ".join(text.lower().split())
        buckets = [zlib.crc32(t[i:i + n].encode()) % dim for i in range(max(1, len(t) - n + 1))]
        counts_PD[row] = np.bincount(buckets, minlength=dim)
    df_D = (counts_PD > 0).sum(axis=0)
    idf_D = np.log((1 + len(texts)) / (1 + df_D)) + 1
    x_PD = (np.log1p(counts_PD) * idf_D).astype(np.float32)
    return x_PD / np.maximum(np.linalg.norm(x_PD, axis=1, keepdims=True), 1e-12)


# ---------------------------------------------------------------------------------------------
# samplers


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


class PrioritizedSampler:
    """Kimi k1.5's prioritized sampling (Kimi Team, "Kimi k1.5: Scaling Reinforcement Learning
    with LLMs", arXiv:2501.12599, §2.3.4): track each prompt's success rate s_i and draw prompts
    with probability P(i) ∝ 1 − s_i, so that the ones the policy fails on come back more often.

    Choices (the report gives only the proportionality):
      s_i ← decay·s_i + (1 − decay)·accuracy on each observation (decay = 0: the latest accuracy,
      i.e. what the current policy does); an unseen prompt has s_i = prior (0.5);
      weights are max(1 − s_i, floor) so that a solved prompt (s_i = 1) keeps a small chance of
      being re-checked (floor = 0.01);
      a batch is drawn without replacement with these probabilities (numpy's weighted sampling without replacement)."""

    def __init__(self, ctx: SamplerContext, *, prior: float = 0.5, decay: float = 0.0, floor: float = 0.01) -> None:
        if not (0 <= prior <= 1 and 0 <= decay < 1 and 0 < floor <= 1):
            raise ValueError(f"sampler 'prioritized': need 0 ≤ prior ≤ 1, 0 ≤ decay < 1, 0 < floor ≤ 1 "
                             f"(got prior={prior}, decay={decay}, floor={floor})")
        self.num_prompts, self.seed, self.decay, self.floor = len(ctx.texts), ctx.seed, decay, floor
        self.success_P = np.full(self.num_prompts, float(prior))
        self.seen_P = np.zeros(self.num_prompts, dtype=bool)
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last: list[int] = []

    def probabilities(self) -> np.ndarray:
        w_P = np.maximum(1.0 - self.success_P, self.floor)
        return w_P / w_P.sum()

    def next_batch(self, n: int) -> list[int]:
        pool = _allowed(self.num_prompts, self.pending, n)
        p = self.probabilities()[pool]
        out = _draw(_rng(self.seed, "prioritized", self.calls), pool, n, p / p.sum())
        self.calls, self.drawn, self.pending, self.last = self.calls + 1, self.drawn + n, self.pending + out, out
        return out

    def observe(self, groups: list[Group]) -> None:
        for g in groups:
            if g.samples:
                i = _prompt(g)
                self.success_P[i] = self.decay * self.success_P[i] + (1 - self.decay) * float(g.metadata["accuracy"])
                self.seen_P[i] = True
        self.pending = []

    def metrics(self) -> dict[str, float]:
        chosen = float(self.success_P[self.last].mean()) if self.last else 0.0
        return {"success_chosen": chosen, "success_mean": float(self.success_P.mean()),
                "seen": float(self.seen_P.mean())}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "success": self.success_P.tolist(), "seen": self.seen_P.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.success_P = np.array(state["success"], dtype=np.float64)
        self.seen_P = np.array(state["seen"], dtype=bool)


class ScheduleSampler:
    """A fixed easy→hard curriculum over a known difficulty (the easy→hard curriculum sampling of
    Kimi k1.5, arXiv:2501.12599, §2.3.4, and the staged schedules of many papers).

    Prompts are ranked by ctx.difficulty (ascending; ties by index). Call k of next_batch
    (k = 0, 1, ...) is in stage s = the number of boundaries ≤ k, and draws uniformly without
    replacement from the easiest ceil((s + 1)/stages · P) prompts (P = number of prompts), so the
    last stage draws from all of them. boundaries: `stages − 1` increasing call numbers; or
    total_steps, which gives boundaries[s − 1] = floor(s · total_steps / stages). E.g. stages=3,
    total_steps=30: calls 0–9 from the easiest third, 10–19 from the easiest two thirds, 20– from
    all. A call counts as one step (a strategy that asks twice per step moves faster: say so in
    total_steps)."""

    def __init__(self, ctx: SamplerContext, *, stages: int = 3, total_steps: int | None = None,
                 boundaries: list[int] | None = None) -> None:
        if ctx.difficulty is None:
            raise ValueError("sampler 'schedule' needs a difficulty per prompt (sampler.difficulty_field)")
        if stages < 1:
            raise ValueError(f"sampler 'schedule': stages must be ≥ 1 (got {stages})")
        if (total_steps is None) == (boundaries is None):
            raise ValueError("sampler 'schedule': give exactly one of total_steps and boundaries")
        if boundaries is None:
            assert total_steps is not None
            boundaries = [s * total_steps // stages for s in range(1, stages)]
        if len(boundaries) != stages - 1 or any(b >= c for b, c in zip(boundaries, boundaries[1:])):
            raise ValueError(f"sampler 'schedule': boundaries must be {stages - 1} increasing step numbers "
                             f"(got {boundaries})")
        self.boundaries, self.stages = [int(b) for b in boundaries], stages
        self.ranked = np.argsort(np.asarray(ctx.difficulty, dtype=np.float64), kind="stable")
        self.difficulty = np.asarray(ctx.difficulty, dtype=np.float64)
        self.num_prompts, self.seed, self.calls, self.drawn = len(ctx.texts), ctx.seed, 0, 0
        self.last: list[int] = []

    def stage(self, call: int) -> int:
        return sum(b <= call for b in self.boundaries)

    def pool(self, call: int) -> np.ndarray:
        return self.ranked[:math.ceil((self.stage(call) + 1) / self.stages * self.num_prompts)]

    def next_batch(self, n: int) -> list[int]:
        out = _draw(_rng(self.seed, "schedule", self.calls), self.pool(self.calls), n)
        self.calls, self.drawn, self.last = self.calls + 1, self.drawn + n, out
        return out

    def observe(self, groups: list[Group]) -> None:
        """A fixed schedule ignores outcomes."""

    def metrics(self) -> dict[str, float]:
        chosen = float(self.difficulty[self.last].mean()) if self.last else 0.0
        return {"stage": float(self.stage(max(self.calls - 1, 0))), "difficulty_chosen": chosen,
                "pool_fraction": len(self.pool(self.calls)) / self.num_prompts}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])


class MoPPSSampler:
    """Model Predictive Prompt Selection (Qu et al., "Can Prompt Difficulty be Online Predicted
    for Accelerating RL Finetuning of Reasoning Models?", arXiv:2507.04632).

    Each prompt's success rate γ has a Beta(α, β) posterior, starting at the prior (α0, β0).
    Observing a group of k samples with s = accuracy·k successes discounts the old evidence
    toward the prior (λ = decay):
        α ← λ·α + (1 − λ)·α0 + s,        β ← λ·β + (1 − λ)·β0 + (k − s).
    Prompts not observed keep their posterior. Selection: draw a candidate pool of
    candidates_factor·n prompts uniformly (without replacement, all prompts if that is more),
    Thompson-sample γ̂ ~ Beta(α, β) for each and keep the n with the smallest (γ̂ − γ*)²
    (γ* = target).

    Defaults: target 0.5, λ = 0.5, α0 = β0 = 1, candidates_factor = 8 (as in the authors' verl
    recipe scripts: bandit_decay_ratio=0.5, ts_ratio=8; the uniform Beta(1, 1) prior is our
    choice)."""

    def __init__(self, ctx: SamplerContext, *, target: float = 0.5, decay: float = 0.5, prior_alpha: float = 1.0,
                 prior_beta: float = 1.0, candidates_factor: float = 8.0) -> None:
        if not (0 <= decay <= 1 and prior_alpha > 0 and prior_beta > 0 and candidates_factor >= 1):
            raise ValueError("sampler 'mopps': need 0 ≤ decay ≤ 1, prior_alpha > 0, prior_beta > 0, "
                             "candidates_factor ≥ 1")
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.target, self.decay, self.candidates_factor = target, decay, candidates_factor
        self.prior_alpha, self.prior_beta = prior_alpha, prior_beta
        self.alpha_P = np.full(self.num_prompts, float(prior_alpha))
        self.beta_P = np.full(self.num_prompts, float(prior_beta))
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last: list[int] = []
        self.last_sampled = 0.0

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "mopps", self.calls)
        allowed = _allowed(self.num_prompts, self.pending, n)
        pool = np.array(_draw(rng, allowed, min(len(allowed), math.ceil(self.candidates_factor * n))))
        gamma = rng.beta(self.alpha_P[pool], self.beta_P[pool])
        out = _closest(rng, pool, gamma, self.target, n)
        sampled = dict(zip(pool.tolist(), gamma.tolist()))
        self.last_sampled = float(np.mean([sampled[i] for i in out]))
        self.calls, self.drawn, self.pending, self.last = self.calls + 1, self.drawn + n, self.pending + out, out
        return out

    def observe(self, groups: list[Group]) -> None:
        lam = self.decay
        for g in groups:
            if not g.samples:
                continue
            i, k = _prompt(g), len(g.samples)
            s = float(g.metadata["accuracy"]) * k
            self.alpha_P[i] = lam * self.alpha_P[i] + (1 - lam) * self.prior_alpha + s
            self.beta_P[i] = lam * self.beta_P[i] + (1 - lam) * self.prior_beta + (k - s)
        self.pending = []

    def posterior_mean(self) -> np.ndarray:
        return self.alpha_P / (self.alpha_P + self.beta_P)

    def metrics(self) -> dict[str, float]:
        if not self.last:
            return {}
        return {"predicted_success": float(self.posterior_mean()[self.last].mean()),
                "sampled_success": self.last_sampled}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "alpha": self.alpha_P.tolist(), "beta": self.beta_P.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.alpha_P = np.array(state["alpha"], dtype=np.float64)
        self.beta_P = np.array(state["beta"], dtype=np.float64)


def similarity_predict(features_PD: np.ndarray, ref_features_MD: np.ndarray, ref_rates_M: np.ndarray,
                       temperature: float) -> np.ndarray:
    """DOTS-style attention prediction: for each prompt p,
    pred_p = Σ_m softmax_m(cos(x_p, x_m) / temperature) · rate_m, over M reference prompts.
    Features are L2-normalised, so cos is a dot product. Shapes (P, D), (M, D), (M,) → (P,)."""
    weights_PM = _softmax(features_PD @ ref_features_MD.T, temperature)
    return weights_PM @ np.asarray(ref_rates_M, dtype=np.float64)


class DOTSSampler:
    """Difficulty-targeted Online daTa Selection ("Improving Data Efficiency for LLM
    Reinforcement Fine-tuning Through Difficulty-targeted Online Data Selection and Rollout
    Replay", arXiv:2506.05316). Rollout replay lives in rlvr.train (sampler.replay_fraction).

    Every batch holds ref_size reference prompts drawn uniformly at random (without replacement);
    they are rolled out and trained on like the rest, and their observed accuracies are the
    only evidence the predictor uses (chosen prompts' outcomes are not, so the evidence is an
    unbiased sample). The predictor keeps each reference prompt's latest accuracy, for the
    ref_memory most recently observed reference prompts, and predicts every prompt's success
    rate as `similarity_predict` over them: a softmax over cosine similarities of
    `text_features` with a temperature. The rest of the batch is the prompts (other than the
    references and those already chosen this step) whose prediction is closest to target, ties
    broken at random. Before any reference is observed every prediction is 0.5, so the first
    batch is uniform.

    Departures and choices (the paper's exact attention predictor was not available to us):
    the paper embeds prompts with a pretrained encoder and predicts from freshly rolled-out
    reference prompts; here the embedding is a hashed character-n-gram TF-IDF vector (no
    downloads), the predictor is the plain softmax-weighted average above (no learned
    calibration), and the references of recent steps are pooled (ref_memory), because
    references are picked in the same call as the rest of the batch, so their outcomes are one
    step old in any case. A batch of n < 2·ref_size (a strategy asking for a few more prompts)
    holds n // 2 references.
    Defaults (ours): ref_size 2 (a quarter of the default 8-prompt batch), target 0.5,
    temperature 0.1, ref_memory 256, feature_dim 1024."""

    def __init__(self, ctx: SamplerContext, *, ref_size: int = 2, target: float = 0.5, temperature: float = 0.1,
                 ref_memory: int = 256, feature_dim: int = 1024) -> None:
        if ref_size < 1 or ref_memory < 1 or temperature <= 0:
            raise ValueError("sampler 'dots': need ref_size ≥ 1, ref_memory ≥ 1, temperature > 0")
        self.features_PD = text_features(ctx.texts, dim=feature_dim)
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.ref_size, self.target, self.temperature, self.ref_memory = ref_size, target, temperature, ref_memory
        self.memory: dict[int, float] = {}
        """Reference prompt → its latest accuracy, oldest observation first."""
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.pending_refs: list[int] = []
        self.last_pred: dict[int, float] = {}
        self.last_error = 0.0

    def predict(self) -> np.ndarray:
        if not self.memory:
            return np.full(self.num_prompts, 0.5)
        refs = np.fromiter(self.memory, dtype=np.int64)
        return similarity_predict(self.features_PD, self.features_PD[refs],
                                  np.fromiter(self.memory.values(), dtype=np.float64), self.temperature)

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "dots", self.calls)
        n_refs = min(self.ref_size, n // 2)
        refs = _draw(rng, _allowed(self.num_prompts, self.pending, n_refs), n_refs)
        pool = _allowed(self.num_prompts, self.pending + refs, n - n_refs)
        pred_P = self.predict()
        rest = _closest(rng, pool, pred_P[pool], self.target, n - n_refs)
        self.last_pred = {i: float(pred_P[i]) for i in rest}
        out = refs + rest
        self.calls, self.drawn = self.calls + 1, self.drawn + n
        self.pending, self.pending_refs = self.pending + out, self.pending_refs + refs
        return out

    def observe(self, groups: list[Group]) -> None:
        refs, errors = set(self.pending_refs), []
        for g in groups:
            if not g.samples:
                continue
            i, acc = _prompt(g), float(g.metadata["accuracy"])
            if i in refs:
                self.memory.pop(i, None)
                self.memory[i] = acc
            elif i in self.last_pred:
                errors.append(abs(self.last_pred[i] - acc))
        while len(self.memory) > self.ref_memory:
            del self.memory[next(iter(self.memory))]
        self.last_error = float(np.mean(errors)) if errors else self.last_error
        self.pending, self.pending_refs = [], []

    def metrics(self) -> dict[str, float]:
        pred = float(np.mean(list(self.last_pred.values()))) if self.last_pred else 0.5
        return {"predicted_success": pred, "prediction_error": self.last_error, "memory": float(len(self.memory))}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "pending_refs": list(self.pending_refs), "memory": [[i, r] for i, r in self.memory.items()],
                "last_error": self.last_error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.pending_refs = [int(i) for i in state["pending_refs"]]
        self.memory = {int(i): float(r) for i, r in state["memory"]}
        self.last_error = float(state.get("last_error", 0.0))  # a metric carried between steps


def logistic_sgd_step(w_D: np.ndarray, b: float, features_BD: np.ndarray, targets_B: np.ndarray, lr: float,
                      l2: float) -> tuple[np.ndarray, float]:
    """One gradient step of logistic regression with soft targets in [0, 1]:
    v = σ(x·w + b), loss = mean cross-entropy(v, target) + l2/2·|w|²,
    ∂loss/∂w = mean((v − target)·x) + l2·w,  ∂loss/∂b = mean(v − target). Returns (w, b)."""
    v_B = 1.0 / (1.0 + np.exp(-(features_BD @ w_D + b)))
    err_B = v_B - targets_B
    return w_D - lr * (err_B @ features_BD / len(err_B) + l2 * w_D), b - lr * float(err_B.mean())


class PCLSampler:
    """Prompt Curriculum Learning ("Prompt Curriculum Learning for Efficient LLM
    Post-Training", arXiv:2510.01135): a value model V(x) predicts each prompt's expected
    reward (here: accuracy) under the current policy; each step draw candidates_factor·n
    candidates uniformly (without replacement), keep the n with V(x) closest to target (0.5),
    and after the update train V on the observed group accuracies. No extra rollouts.

    Departure: the paper's value model is a small language model trained with squared error;
    here V(x) = σ(w·φ(x) + b), linear in `text_features` φ, trained online by `updates` full
    gradient steps of soft-label logistic regression (cross-entropy, whose gradient does not
    vanish at saturated predictions as the squared error on a sigmoid does) on each observe's
    groups. It starts at w = 0, b = 0 (every prediction 0.5: the first batch is uniform).
    Defaults (ours): target 0.5, candidates_factor 4, lr 2.0, l2 1e-4, updates 4,
    feature_dim 1024."""

    def __init__(self, ctx: SamplerContext, *, target: float = 0.5, candidates_factor: float = 4.0, lr: float = 2.0,
                 l2: float = 1e-4, updates: int = 4, feature_dim: int = 1024) -> None:
        if candidates_factor < 1 or lr <= 0 or l2 < 0 or updates < 1:
            raise ValueError("sampler 'pcl': need candidates_factor ≥ 1, lr > 0, l2 ≥ 0, updates ≥ 1")
        self.features_PD = text_features(ctx.texts, dim=feature_dim)
        self.num_prompts, self.seed = len(ctx.texts), ctx.seed
        self.target, self.candidates_factor, self.lr, self.l2, self.updates = target, candidates_factor, lr, l2, updates
        self.w_D, self.b = np.zeros(feature_dim), 0.0
        self.calls, self.drawn = 0, 0
        self.pending: list[int] = []
        self.last_pred, self.last_mse = 0.5, 0.0

    def predict(self, indices: np.ndarray | list[int]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-(self.features_PD[indices] @ self.w_D + self.b)))

    def next_batch(self, n: int) -> list[int]:
        rng = _rng(self.seed, "pcl", self.calls)
        allowed = _allowed(self.num_prompts, self.pending, n)
        pool = np.array(_draw(rng, allowed, min(len(allowed), math.ceil(self.candidates_factor * n))))
        out = _closest(rng, pool, self.predict(pool), self.target, n)
        self.last_pred = float(self.predict(out).mean())
        self.calls, self.drawn, self.pending = self.calls + 1, self.drawn + n, self.pending + out
        return out

    def observe(self, groups: list[Group]) -> None:
        kept = [g for g in groups if g.samples]
        if kept:
            idx = [_prompt(g) for g in kept]
            acc_B = np.array([float(g.metadata["accuracy"]) for g in kept])
            self.last_mse = float(((self.predict(idx) - acc_B) ** 2).mean())
            for _ in range(self.updates):
                self.w_D, self.b = logistic_sgd_step(self.w_D, self.b, self.features_PD[idx], acc_B, self.lr, self.l2)
        self.pending = []

    def metrics(self) -> dict[str, float]:
        return {"predicted_success": self.last_pred, "value_mse": self.last_mse}

    @property
    def epoch(self) -> float:
        return self.drawn / self.num_prompts

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls, "drawn": self.drawn, "pending": list(self.pending),
                "w": self.w_D.tolist(), "b": self.b}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.calls, self.drawn = int(state["calls"]), int(state["drawn"])
        self.pending = [int(i) for i in state["pending"]]
        self.w_D, self.b = np.array(state["w"], dtype=np.float64), float(state["b"])


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


CURRICULA: dict[str, type] = {
    "uniform": UniformCurriculum,
    "weighted": WeightedSampler,
    "prioritized": PrioritizedSampler,
    "schedule": ScheduleSampler,
    "mopps": MoPPSSampler,
    "dots": DOTSSampler,
    "pcl": PCLSampler,
    "dump": DUMPSampler,
    "sec": SECSampler,
}


def build_sampler(name: str, ctx: SamplerContext, kwargs: dict[str, Any] | None = None) -> Curriculum:
    """The sampler `name` over ctx's prompts with keyword arguments `kwargs` (from the config).
    Raises a ValueError naming the valid samplers, or the unknown keyword and the accepted ones."""
    kwargs = dict(kwargs or {})
    if name not in CURRICULA:
        near = difflib.get_close_matches(name, list(CURRICULA), n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ValueError(f"unknown sampler {name!r}{hint} (choose from {', '.join(CURRICULA)})")
    cls = CURRICULA[name]
    check_keywords(f"sampler {name!r}", cls, kwargs)
    sampler: Curriculum = cls(ctx, **kwargs)
    return sampler
