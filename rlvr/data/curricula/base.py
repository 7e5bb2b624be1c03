"""Shared pieces of the curricula: the context a sampler is built from, the protocol, and the
helpers for drawing prompts deterministically."""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from rlvr.data.sampler import Sampler
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


NO_ACCURACY = "a sampler observed a group without its accuracy (collection sets it)"
"""Every collection sets `Group.accuracy` (None only for a group without a verdict); a sampler
that meets a group without it was given one from a path that forgot `with_accuracy`."""


def _rng(seed: int, tag: str, counter: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(tag.encode()), counter])


def _prompt(g: Group) -> int:
    return g.samples[0].prompt_index


def _accuracy(g: Group) -> float:
    if g.accuracy is None:
        raise ValueError(f"{NO_ACCURACY}: {g.prompt[:60]!r}")
    return g.accuracy


def _mean_abs_advantage(g: Group) -> float:
    advantages = g.advantages or ()
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
