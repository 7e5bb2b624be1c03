"""From rewards to advantages: shaping, the outcome estimators with the inputs the loop supplies,
turn-level credit, and GAE's per-token rewards and values."""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from rlvr.algos import ESTIMATORS, SHAPING, turn_advantages
from rlvr.train.batches import batches
from rlvr.train.inputs import estimator_inputs, per_token
from rlvr.train.rollouts import is_correct
from rlvr.train.settings import UpdateSettings
from rlvr.types import Completion, Group, Sample


def shaped_rewards(groups: list[Group], s: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards_PG after the configured shaping functions, and their metrics.

    A sample excluded by a reward (it returned None) takes the mean reward of the rest of its
    group, so it moves neither the group's baseline nor, in expectation, its spread; it is then
    left out of the loss (update_policy)."""
    rewards_PG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    excluded_PG = torch.tensor([[x.excluded for x in g.samples] for g in groups], dtype=torch.bool)
    if excluded_PG.any():
        kept_PG = (~excluded_PG).float()
        fill_P1 = (rewards_PG * kept_PG).sum(1, keepdim=True) / kept_PG.sum(1, keepdim=True).clamp(min=1)
        rewards_PG = torch.where(excluded_PG, fill_P1, rewards_PG)
    metrics: dict[str, float] = {}
    if not s.shaping:
        return rewards_PG, metrics
    # the policy's own tokens: an episode's observations are not its length
    lengths_PG = torch.tensor([[x.sampled_tokens for x in g.samples] for g in groups])
    # correct: the first (correctness) reward function gave full marks, as in the accuracy metric
    correct_PG = torch.tensor([[is_correct(x, next(iter(x.reward_parts), "")) for x in g.samples] for g in groups])
    for name, kwargs in s.shaping:
        rewards_PG, m = SHAPING[name](rewards_PG, lengths_PG, correct_PG, s.max_tokens, **kwargs)
        metrics |= m
    metrics["shaping/reward_mean"] = float(rewards_PG.mean())
    return rewards_PG, metrics


def compute_advantages(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    """advantages_PG from the groups' (shaped) rewards with the configured outcome estimator
    (without a KL in the reward, which needs the models; ``update_policy`` applies it)."""
    if per_token(ESTIMATORS[s.advantage]):
        raise ValueError(f"advantage {s.advantage!r} is per token and needs a critic: use update_policy")
    return outcome_advantages(groups, shaped_rewards(groups, s)[0], s)


def outcome_advantages(groups: list[Group], rewards_PG: torch.Tensor, s: UpdateSettings) -> torch.Tensor:
    """The outcome estimator on rewards_PG, with the inputs only the loop has filled in by name."""
    estimator = ESTIMATORS[s.advantage]
    return estimator(rewards_PG, **s.advantage_kwargs, **estimator_inputs(estimator, groups, s))


def units(episodes: list[Sample]) -> tuple[list[Sample], list[int]]:
    """The rows an update trains on, and the group sample each belongs to: a sample is one row;
    a summarised episode (SUPO) is one row per segment, each with the episode's reward."""
    if not any(x.segments for x in episodes):
        return episodes, list(range(len(episodes)))
    units, owner = [], []
    for i, x in enumerate(episodes):
        for prompt_ids, completion in x.segments:
            units.append(Sample(prompt_ids, completion, x.reward, x.reward_parts, x.prompt_index))
            owner.append(i)
        units.append(x)
        owner.append(i)
    return units, owner


def check_combination(s: UpdateSettings, per_token: bool, kl_in_reward: bool, summarised: bool) -> None:
    """Refuse what an update cannot train (a run's config refuses these earlier, with its own words)."""
    if (per_token or kl_in_reward) and summarised:
        raise ValueError("summarised episodes (env.summarize) train with outcome advantages: "
                         "advantage = \"gae\" and kl_placement = \"reward\" are not supported with them")
    if s.turn_credit and (per_token or kl_in_reward or s.shaping or s.advantage != "grpo"):
        raise ValueError("algo.credit = \"turn\" computes its own group-relative advantages from the turn "
                         "rewards: use it with advantage = \"grpo\", no shaping and no KL in the reward")


def turn_credit(groups: list[Group], samples: list[Sample], owner: list[int], s: UpdateSettings) -> list[torch.Tensor]:
    """Per-token advantages from each group's turn rewards (rlvr.algos.turn_advantages): a token
    gets the advantage of the turn it belongs to (``Completion.turn_index``)."""
    per_episode: list[list[float]] = []
    for g in groups:
        if "turn_rewards" not in g.metadata:
            raise ValueError("algo.credit = \"turn\" needs multi-turn episodes (an [env] section): a group "
                             f"without turn rewards: {g.prompt[:60]!r}")
        per_episode += turn_advantages(g.metadata["turn_rewards"], gamma=s.turn_gamma)
    out = []
    for u, x in enumerate(samples):
        turns = per_episode[owner[u]]
        index = x.completion.turn_index or (0,) * len(x.completion.token_ids)
        # a summary sampled after the last turn has no return left to credit
        out.append(torch.tensor([turns[t] if t < len(turns) else 0.0 for t in index], dtype=torch.float32))
    return out


@torch.no_grad()


def score_values(
    critic: torch.nn.Module, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """The critic's values of each sample's completion tokens (zeros outside `which`)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(critic.parameters()).device
    for micro, batch in batches(samples, sorted(which), pad, device, s.micro_batch_size, s.micro_batch_tokens):
        values_BT = critic(batch["input_ids"], batch["attention_mask"])
        for row, i in enumerate(micro):
            out[i] = values_BT[row][batch["completion_mask"][row]].float().cpu()
    return out


def token_advantages(
    samples: list[Sample], rewards_PG: torch.Tensor, kl_N: list[torch.Tensor], values: list[torch.Tensor],
    kept: set[int], s: UpdateSettings, turn_rewards: list[Sequence[float] | None],
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """GAE over the kept samples: -β·KL on every token; the outcome reward on the last token, or
    for an episode each turn's reward on that turn's last sampled token (``turn_rewards``, one
    entry per sample; what shaping changed in the total stays on the last token)."""
    rewards_B = rewards_PG.flatten()
    rows = sorted(kept)
    width = max((len(samples[i].completion.token_ids) for i in rows), default=0)
    mask_BT = torch.zeros((len(rows), width), dtype=torch.bool)
    rewards_BT = torch.zeros((len(rows), width))
    values_BT = torch.zeros((len(rows), width))
    for r, i in enumerate(rows):
        n = len(samples[i].completion.token_ids)
        mask_BT[r, :n] = True
        rewards_BT[r, :n] = -s.kl_coef * kl_N[i] if s.kl_in_reward else 0.0
        for position, reward in reward_positions(samples[i].completion, float(rewards_B[i]), turn_rewards[i]):
            rewards_BT[r, position] += reward
        values_BT[r, :n] = values[i]
    advantages = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    returns = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    if rows:
        adv_BT, ret_BT = ESTIMATORS[s.advantage](rewards_BT, mask_BT, values_BT=values_BT, **s.advantage_kwargs)
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
