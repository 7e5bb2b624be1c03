"""The value model for PPO with GAE: a copy of the policy's transformer with a scalar head.

Initialising the critic from the policy (rather than from scratch) is what InstructGPT-style
PPO does (Ouyang et al., arXiv:2203.02155, initialise the value function from the reward model;
OpenRLHF and verl default to the policy or reward checkpoint). The head starts at zero, so the first
values are 0 and the first advantages are the discounted returns themselves.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from rlvr.algos.distill import OpdOptions
from rlvr.algos.process import ProcessOptions
from rlvr.algos.registry import within


class Critic(nn.Module):
    """V(prefix) for every position: ``values_BT[:, t]`` is the value of the state *before*
    token t, aligned like ``token_logprobs`` (the value of choosing token t's context)."""

    def __init__(self, policy: PreTrainedModel) -> None:
        super().__init__()
        if getattr(policy.config, "vision_config", None) is not None:
            raise ValueError("a critic (algo.advantage = \"gae\") for a vision-language model is not supported yet: "
                             "its values would need the prompts' pixel inputs; use a critic-free estimator (docs/vlm.md)")
        self.trunk = copy.deepcopy(policy.base_model).train()
        self.trunk.requires_grad_(True)
        hidden = policy.config.hidden_size
        weight = next(policy.parameters())
        self.head = nn.Linear(hidden, 1, dtype=weight.dtype, device=weight.device)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids_BT: Tensor, attention_mask_BT: Tensor) -> Tensor:
        hidden_BTH = self.trunk(input_ids=input_ids_BT, attention_mask=attention_mask_BT).last_hidden_state
        values_BT = torch.zeros(input_ids_BT.shape, dtype=torch.float32, device=input_ids_BT.device)
        # the state before token t is everything up to t - 1, whose last hidden state is at t - 1
        return torch.cat([values_BT[:, :1], self.head(hidden_BTH[:, :-1]).squeeze(-1).float()], dim=1)


def value_loss(values_BT: Tensor, old_values_BT: Tensor, returns_BT: Tensor, mask_BT: Tensor, *,
               clip: float | None = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped value loss, per token: ½ max((V - R)², (V_old + clip(V - V_old, ±clip) - R)²).

    Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347 (the clipped
    value objective of the OpenAI baselines implementation; OpenRLHF's default clip is 0.2).
    ``clip = None`` is the plain squared error. Masked positions are 0. Metrics:
    ``value_clip_fraction`` (tokens where the clipped term was the larger) and ``value_mean``.
    """
    mask_BT = mask_BT.bool()
    zeros_BT = torch.zeros_like(values_BT)
    values_BT = torch.where(mask_BT, values_BT, zeros_BT)
    error_BT = (values_BT - returns_BT) ** 2
    if clip is None:
        loss_BT, clipped_BT = 0.5 * error_BT, torch.zeros_like(mask_BT)
    else:
        clipped_values_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip, clip)
        clipped_error_BT = (clipped_values_BT - returns_BT) ** 2
        loss_BT = 0.5 * torch.maximum(error_BT, clipped_error_BT)
        clipped_BT = clipped_error_BT > error_BT
    loss_BT = torch.where(mask_BT, loss_BT, zeros_BT)
    n = mask_BT.sum().clamp(min=1)
    with torch.no_grad():
        metrics = {"value_clip_fraction": (clipped_BT & mask_BT).sum() / n,
                   "value_mean": values_BT.detach().sum() / n}
    return loss_BT, metrics


@dataclass(frozen=True)
class GaeOptions:
    """``algo.advantage_kwargs`` of ``advantage = "gae"``: GAE's discount and trace decay, and the critic's."""

    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE's λ (1 = Monte-Carlo returns minus the value, 0 = one-step TD)."""
    whiten: bool = True
    """Shift and scale the advantages to mean 0, std 1 over the batch's trained tokens."""
    critic_lr: float = 1e-5
    """Learning rate of the critic's AdamW."""
    value_clip: float | None = 0.2
    """Clip of the value loss around the critic's old values (None = plain squared error)."""

    def __post_init__(self) -> None:
        within("gamma", self.gamma, 0.0, 1.0)
        within("lam", self.lam, 0.0, 1.0)
        if self.critic_lr <= 0 or (self.value_clip is not None and self.value_clip <= 0):
            raise ValueError(f"critic_lr and value_clip must be > 0 (got {self.critic_lr}, {self.value_clip})")


PER_TOKEN: dict[str, type] = {"gae": GaeOptions, "opd": OpdOptions, "process": ProcessOptions}
"""Advantages computed per token by a model beside the policy, by ``algo.advantage`` name, with
their options: PPO's critic (rlvr.train.methods.ppo), on-policy distillation's teacher
(rlvr.train.methods.distill), a process reward model (rlvr.train.methods.process)."""
