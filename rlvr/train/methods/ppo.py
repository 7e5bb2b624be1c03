"""PPO with a learned critic (``algo.advantage = "gae"``): a value model trained beside the policy.

The critic's values enter GAE's per-token advantages (rlvr.algos.advantages.gae_advantages), its
clipped value loss (rlvr.train.critic.value_loss) is minimised on the same micro-batches as the
policy loss, and it steps with the policy. All of it plugs into the update through one seam,
`rlvr.train.update.Credit`; the critic's model and optimizer are part of every checkpoint.

Schulman et al., "Proximal Policy Optimization Algorithms", arXiv:1707.06347; as used for LMs in
Ouyang et al., "Training language models to follow instructions with human feedback",
arXiv:2203.02155.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rlvr.algos import aggregate_loss
from rlvr.algos.advantages import gae_advantages
from rlvr.train.batches import batches, token_rows
from rlvr.algos import PER_TOKEN
from rlvr.options import GaeOptions
from rlvr.train.critic import Critic, value_loss
from rlvr.train.learner import Learner, learner_for
from rlvr.train.methods.base import Extras, Method, Plan, RankInfo, SetupInfo
from rlvr.train.settings import UpdateSettings
from rlvr.types import Completion, Group, Sample

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


Placed = Callable[[list[Group], list[Sample], set[int], torch.Tensor], list[list[tuple[int, float]] | None]]
"""Per sample, the rewards GAE sees and the token each sits on, from the groups, the samples, the
kept ones and the (shaped) outcome rewards; None for a sample keeps the outcome placement
(`reward_positions`). Process supervision's step scores come this way."""


class CriticCredit:
    """GAE with a critic, as the update's `Credit` seam: values and returns are computed in
    `advantages`, the value loss in `backward`, and the critic steps in `step`. ``placed``, when
    given, decides where the rewards sit (see `Placed`)."""

    def __init__(self, critic: Learner, options: GaeOptions, placed: Placed | None = None) -> None:
        self.critic, self.options, self.placed = critic, options, placed
        self._values: list[torch.Tensor] = []
        self._returns: list[torch.Tensor] = []
        self._norms: list[float] = []

    def advantages(self, groups: list[Group], samples: list[Sample], kept: set[int], rewards_PG: torch.Tensor,
                   kl_N: list[torch.Tensor] | None, s: UpdateSettings, pad_token_id: int) -> list[torch.Tensor]:
        if len(samples) != sum(len(g.samples) for g in groups):
            raise ValueError("summarised episodes (env.summarize) train with outcome advantages: "
                             "advantage = \"gae\" is not supported with them")
        self._values = score_values(self.critic.model, samples, s, pad_token_id, kept)
        turn_rewards = [tr for g in groups for tr in g.metadata.get("turn_rewards", [None] * len(g.samples))]
        placed = self.placed(groups, samples, kept, rewards_PG) if self.placed is not None else None
        advantages, self._returns = token_advantages(samples, rewards_PG, kl_N, self._values, kept, s.kl.coef,
                                                     turn_rewards, self.options, placed)
        self._norms = []
        return advantages

    def backward(self, batch: dict[str, torch.Tensor], micro: list[int], s: UpdateSettings,
                 totals: dict[str, float], sums: dict[str, float]) -> dict[str, torch.Tensor]:
        mask_BT, where_BT = batch["loss_mask"], batch["completion_mask"]
        values_BT = self.critic.model(batch["input_ids"], batch["attention_mask"])
        v_loss_BT, metrics = value_loss(values_BT, token_rows(self._values, micro, where_BT),
                                        token_rows(self._returns, micro, where_BT), mask_BT,
                                        clip=self.options.value_clip)
        v_loss = aggregate_loss(v_loss_BT, mask_BT, mode=s.loss.aggregation, max_tokens=s.loss.max_tokens, **totals)
        v_loss.backward()
        sums["value_loss"] += float(v_loss.detach())
        return metrics

    def step(self) -> None:
        self._norms.append(self.critic.step())

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        total = sums.pop("value_loss", 0.0)
        if not self._norms:
            return {}
        return {"value_loss": total / len(self._norms), "critic_grad_norm": statistics.fmean(self._norms)}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.critic.model.state_dict(), "learner": self.critic.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.critic.model.load_state_dict(state["model"])
        self.critic.load_state_dict(state["learner"])


def critic_credit(cfg: RunConfig, policy: PreTrainedModel, optimizer_steps: int) -> CriticCredit | None:
    """PPO's critic, initialised from the policy, when ``cfg`` asks for a per-token advantage; else None.
    (Each data-parallel learner rank builds its own replica the same way.)"""
    a = cfg.algo
    if PER_TOKEN.get(a.advantage) is not GaeOptions:
        return None
    return new_critic(cfg, policy, optimizer_steps, GaeOptions(**a.advantage_kwargs))


def new_critic(cfg: RunConfig, policy: PreTrainedModel, optimizer_steps: int, options: GaeOptions,
               placed: Placed | None = None) -> CriticCredit:
    """A critic initialised from the policy, with its own optimizer (train.optimizer) on the run's schedule."""
    critic = learner_for(Critic(policy), cfg.train, optimizer_steps, lr=options.critic_lr)
    return CriticCredit(critic, options, placed)


class CriticMethod(Method):
    state_key = "critic"
    state_required = True

    def __init__(self, credit: CriticCredit) -> None:
        self.credit = credit

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, credit=self.credit))

    def state_dict(self) -> dict[str, Any]:
        return self.credit.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.credit.load_state_dict(state)


def on_rank(cfg: RunConfig, policy: PreTrainedModel, info: RankInfo) -> Extras | None:
    credit = critic_credit(cfg, policy, info.optimizer_steps)
    return None if credit is None else Extras(credit=credit)


def check(cfg: RunConfig) -> None:
    """What a learned critic cannot train beside (run when a run opens, before the model loads)."""
    a = cfg.algo
    if cfg.lora.rank and (a.advantage == "gae" or a.advantage_kwargs.get("credit") == "gae"):
        raise ValueError("lora.rank > 0 with advantage = \"gae\" is not supported yet: the critic copies the "
                         "policy's trunk, which LoRA wraps; use an outcome estimator or full fine-tuning")
    if cfg.env.summarize and a.advantage == "gae":
        raise ValueError("env.summarize trains segments with the episode's outcome advantage: it does not "
                         "combine with advantage = \"gae\"")


def build(run: Run, info: SetupInfo) -> Method | None:
    extras = on_rank(run.cfg, run.learner.model, RankInfo.of(run, info))
    return None if extras is None else CriticMethod(extras.credit)  # type: ignore[arg-type]


@torch.no_grad()
def score_values(
    critic: torch.nn.Module, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """The critic's values of each sample's completion tokens (zeros outside `which`)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(critic.parameters()).device
    p = s.passes
    for micro, batch in batches(samples, sorted(which), pad, device, p.micro_batch_size, p.micro_batch_tokens):
        values_BT = critic(batch["input_ids"], batch["attention_mask"])
        for row, i in enumerate(micro):
            out[i] = values_BT[row][batch["completion_mask"][row]].float().cpu()
    return out


def token_advantages(
    samples: list[Sample], rewards_PG: torch.Tensor, kl_N: list[torch.Tensor] | None, values: list[torch.Tensor],
    kept: set[int], kl_coef: float, turn_rewards: list[Sequence[float] | None], options: GaeOptions,
    placed: list[list[tuple[int, float]] | None] | None = None,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over the kept samples: -β·KL on every token (``kl_N``, when the KL sits in the reward;
    0 at tokens an environment injected, which the learner does not score: the policy did not choose them);
    the outcome reward on the last token, or for an episode each turn's reward on that turn's last
    sampled token (``turn_rewards``, one entry per sample; what shaping changed in the total stays
    on the last token); or, where ``placed`` gives a sample's (position, reward) list, those."""
    rewards_B = rewards_PG.flatten()
    rows = sorted(kept)
    width = max((len(samples[i].completion.token_ids) for i in rows), default=0)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.bool)
    rewards_BT = torch.zeros((len(rows), width))
    values_BT = torch.zeros((len(rows), width))
    for r, i in enumerate(rows):
        n = len(samples[i].completion.token_ids)
        mask_BT[r, :n] = True
        rewards_BT[r, :n] = -kl_coef * kl_N[i] if kl_N is not None else 0.0
        where = placed[i] if placed is not None and placed[i] is not None else None
        for position, reward in where if where is not None else reward_positions(samples[i].completion,
                                                                                float(rewards_B[i]), turn_rewards[i]):
            rewards_BT[r, position] += reward
        values_BT[r, :n] = values[i]
    advantages = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    returns = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    if rows:
        adv_BT, ret_BT = gae_advantages(rewards_BT, mask_BT, values_BT=values_BT, gamma=options.gamma,
                                        lam=options.lam, whiten=options.whiten)
        for r, i in enumerate(rows):
            advantages[i], returns[i] = adv_BT[r][mask_BT[r]], ret_BT[r][mask_BT[r]]
    return advantages, returns


def reward_positions(completion: Completion, total: float,
                     turn_rewards: Sequence[float] | None) -> list[tuple[int, float]]:
    """Where a completion's reward lands for GAE: ``total`` on its last token; for an episode,
    turn t's reward on the last token the policy sampled in turn t (``Completion.turn_index``,
    ``loss_mask`` 1), and ``total - sum(turn_rewards)`` (shaping, an excluded sample's fill) on
    the last token."""
    n = len(completion.token_ids)
    if not n:
        return []
    if turn_rewards is None or completion.turn_index is None:
        return [(n - 1, total)]
    mask = completion.loss_mask or (1,) * n
    last_sampled: dict[int, int] = {}
    for position, (turn, sampled) in enumerate(zip(completion.turn_index, mask)):
        if sampled:
            last_sampled[turn] = position
    placed = [(last_sampled.get(t, n - 1), float(r)) for t, r in enumerate(turn_rewards)]
    return [*placed, (n - 1, total - sum(r for _, r in placed))]
