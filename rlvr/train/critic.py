"""The value model for PPO with GAE: a copy of the policy's transformer with a scalar head.

Initialising the critic from the policy (rather than from scratch) is what InstructGPT-style
PPO does (Ouyang et al., arXiv:2203.02155, initialise the value function from the reward model;
OpenRLHF and verl default to the policy or reward checkpoint). The head starts at zero, so the first
values are 0 and the first advantages are the discounted returns themselves.
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel



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
