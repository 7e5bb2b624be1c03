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
is ``g.samples[0].prompt_index``, its outcome ``g.accuracy`` (share of correct
samples) and ``g.advantages`` (one per sample, what the update used). Groups of prompts a sampler did not
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
from typing import Any

from rlvr.algos.registry import check_keywords
from rlvr.data.curricula.base import Curriculum, SamplerContext, text_features
from rlvr.data.curricula.prompts import (
    DOTSSampler,
    MoPPSSampler,
    PCLSampler,
    PrioritizedSampler,
    ScheduleSampler,
    logistic_sgd_step,
    similarity_predict,
)
from rlvr.data.curricula.sources import DUMPSampler, SECSampler, UniformCurriculum, WeightedSampler

__all__ = ["CURRICULA", "Curriculum", "DOTSSampler", "DUMPSampler", "MoPPSSampler", "PCLSampler", "PrioritizedSampler",
           "SECSampler", "SamplerContext", "ScheduleSampler", "UniformCurriculum", "WeightedSampler", "build_sampler",
           "logistic_sgd_step", "similarity_predict", "text_features"]


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
