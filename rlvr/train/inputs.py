"""The inputs the loop supplies to the policy losses, by the keyword each loss names.

A policy loss that needs more than log-probs and advantages names a keyword from
`rlvr.algos.registry.LOOP_INPUTS` (`correct_BT`, `offpolicy_BT`, `loss_state`, ...); this module
is the one place that knows how each is computed from a step's groups, so the update asks what a
loss takes, never which loss it has. (An advantage estimator's inputs arrive as one record:
rlvr.train.advantages.advantage_inputs.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rlvr.algos.registry import loop_inputs
from rlvr.train.rollouts import is_correct, judged_accuracy
from rlvr.types import Group, Sample


def keeps_state(loss: Callable[..., Any]) -> bool:
    """Whether the loss keeps a dict across steps (``loss_state``: R²VPO's λ)."""
    return "loss_state" in loop_inputs(loss)


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
        # a group's rate over the samples its correctness reward judged (a sample without a verdict
        # trains on nothing; a group with none trains on nothing at all)
        rates = [judged_accuracy(g.samples, next(iter(g.samples[0].reward_parts), "")) or 0.0 for g in groups]
        per_sample = {"correct_BT": [c for row in correct for c in row],
                      "group_accuracy_BT": [rate for row, rate in zip(correct, rates) for _ in row]}
        for name in wanted:
            rows[name] = [torch.full((len(x.completion.token_ids),), per_sample[name][owner[u]])
                          for u, x in enumerate(samples)]
    return rows
