"""The inputs the loop supplies to the formula functions, by the keyword each function names.

An advantage estimator or a policy loss that needs more than rewards (or log-probs and
advantages) names a keyword from `rlvr.algos.registry.LOOP_INPUTS` (`pool_mean_P`,
`correct_BT`, `loss_state`, ...); this module is the one place that knows how each is
computed from a step's groups, so the update asks what a function takes, never which
function it has.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

from rlvr.algos import ESTIMATORS
from rlvr.algos.registry import loop_inputs
from rlvr.train.rollouts import is_correct
from rlvr.train.settings import UpdateSettings
from rlvr.types import Group, Sample


def per_token(estimator: Callable[..., Any]) -> bool:
    """Whether the estimator works on token rewards with a critic's values (GAE) rather than on outcome rewards."""
    return "values_BT" in loop_inputs(estimator)


def needs_greedy_baseline(advantage: str) -> bool:
    """Whether the estimator takes the reward of each prompt's greedy completion (ReMax)."""
    return "baseline_P" in loop_inputs(ESTIMATORS[advantage])


def keeps_state(loss: Callable[..., Any]) -> bool:
    """Whether the loss keeps a dict across steps (``loss_state``: R²VPO's λ)."""
    return "loss_state" in loop_inputs(loss)


def estimator_inputs(estimator: Callable[..., Any], groups: list[Group], s: UpdateSettings) -> dict[str, torch.Tensor]:
    """The outcome estimator's loop inputs, each computed from the groups."""
    return {name: _PROVIDERS[name](groups, s) for name in loop_inputs(estimator)}


def _greedy_baseline(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    missing = [g.prompt[:40] for g in groups if g.greedy_reward is None]
    if missing:
        raise ValueError(f"advantage {s.advantage!r} needs each group's greedy_reward (the reward of a greedy "
                         f"completion; `rlvr train` adds it); missing for {missing[0]!r}")
    return torch.tensor([float(g.greedy_reward) for g in groups])  # type: ignore[arg-type]


def _strata(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    if s.stratum_key is None:
        raise ValueError(f"advantage {s.advantage!r} needs algo.stratum_key: the name of the reward function "
                         "whose value is each sample's stratum (give it weight 0 to keep it out of the reward)")
    for g in groups:
        for x in g.samples:
            if s.stratum_key not in x.reward_parts:
                raise ValueError(f"algo.stratum_key {s.stratum_key!r} is not a reward of this run "
                                 f"(rewards: {', '.join(sorted(x.reward_parts))})")
    return torch.tensor([[x.reward_parts[s.stratum_key] for x in g.samples] for g in groups])


def _pools(groups: list[Group]) -> list[list[float]]:
    """Every reward generated for each prompt: a pooling strategy's pool_rewards, else the group's."""
    return [list(g.rewards if g.pool_rewards is None else g.pool_rewards) for g in groups]


def _pool_mean(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    return torch.tensor([statistics.fmean(p) for p in _pools(groups)])


def _pool_std(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    return torch.tensor([statistics.stdev(p) if len(p) > 1 else 0.0 for p in _pools(groups)])


def _reward_parts(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    # one slice per reward component, by name: never a flag ("<name>/error", "<name>/excluded") or a
    # weight-0 diagnostic (an environment's "turns", a GRPO-RoC quality check)
    present = {k for g in groups for x in g.samples for k in x.reward_parts}
    names = sorted(present & set(s.reward_components) if s.reward_components else {k for k in present if "/" not in k})
    if not names:
        raise ValueError(f"no reward component among the reward parts {sorted(present)} "
                         f"(components: {list(s.reward_components)})")
    return torch.tensor([[[x.reward_parts.get(k, 0.0) for x in g.samples] for g in groups] for k in names],
                        dtype=torch.float32)


_PROVIDERS: dict[str, Callable[[list[Group], UpdateSettings], torch.Tensor]] = {
    "baseline_P": _greedy_baseline,
    "strata_PG": _strata,
    "pool_mean_P": _pool_mean,
    "pool_std_P": _pool_std,
    "reward_parts_KPG": _reward_parts,
}
"""How each outcome-estimator input of rlvr.algos.registry.LOOP_INPUTS is computed."""


def loss_rows(loss: Callable[..., Any], groups: list[Group], samples: list[Sample],
              owner: list[int]) -> dict[str, list[torch.Tensor]]:
    """The per-sample values behind a loss's per-token loop inputs, repeated over each completion
    token of each trained row (``samples``, whose ``owner`` is the group sample they belong to)."""
    names = loop_inputs(loss)
    rows: dict[str, list[torch.Tensor]] = {}
    if "offpolicy_BT" in names:
        rows["offpolicy_BT"] = [torch.full((len(x.completion.token_ids),), float(x.off_policy)) for x in samples]
    wanted = {"correct_BT", "group_accuracy_BT"} & set(names)
    if wanted:
        correct = [[float(is_correct(x, next(iter(x.reward_parts), ""))) for x in g.samples] for g in groups]
        per_sample = {"correct_BT": [c for row in correct for c in row],
                      "group_accuracy_BT": [statistics.fmean(row) for row in correct for _ in row]}
        for name in wanted:
            rows[name] = [torch.full((len(x.completion.token_ids),), per_sample[name][owner[u]])
                          for u, x in enumerate(samples)]
    return rows
