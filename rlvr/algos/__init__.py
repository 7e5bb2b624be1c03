"""Algorithms as pure tensor functions: advantages, KL estimators, policy losses, aggregation."""

from __future__ import annotations

from rlvr.algos.advantages import ESTIMATORS, group_advantages, turn_advantages
from rlvr.algos.aggregation import AGGREGATIONS, aggregate_loss
from rlvr.algos.divergence import DIVERGENCES
from rlvr.algos.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from rlvr.algos.losses import LOSSES, ppo_clip_loss
from rlvr.algos.offpolicy import CORRECTIONS, mismatch_metrics
from rlvr.algos.shaping import SHAPING
from rlvr.algos.distill import OpdOptions
from rlvr.algos.process import ProcessOptions
from rlvr.options import GaeOptions

PER_TOKEN: dict[str, type] = {"gae": GaeOptions, "opd": OpdOptions, "process": ProcessOptions}
"""Advantages computed per token by a model beside the policy, by ``algo.advantage`` name, with
their options: PPO's critic (rlvr.train.methods.ppo), on-policy distillation's teacher
(rlvr.train.methods.distill), a process reward model (rlvr.train.methods.process)."""

__all__ = [
    "AGGREGATIONS",
    "CORRECTIONS",
    "DIVERGENCES",
    "ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSSES",
    "PER_TOKEN",
    "SHAPING",
    "aggregate_loss",
    "group_advantages",
    "turn_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "mismatch_metrics",
    "ppo_clip_loss",
]
