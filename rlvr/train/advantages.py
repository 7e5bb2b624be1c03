"""From rewards to advantages: shaping, the outcome estimators with the inputs the loop supplies
(`AdvantageInputs`), and turn-level credit. (GAE's per-token rewards and values are PPO's:
rlvr.train.methods.ppo.)"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch

from rlvr.algos import ESTIMATORS, SHAPING, turn_advantages
from rlvr.algos.advantages import AdvantageInputs, wants_greedy
from rlvr.config import RunConfig
from rlvr.options import TURN_CREDIT_ALONE
from rlvr.train.rollouts import is_correct
from rlvr.train.settings import UpdateSettings
from rlvr.types import Group, Sample


def shaped_rewards(groups: list[Group], s: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards_PG after the configured shaping functions, and their metrics.

    A sample excluded by a reward (it returned None) takes the mean reward of the rest of its
    group, so it moves no mean baseline; it is then left out of the loss (update_policy). Its
    value would narrow the group's standard deviation (the same squares over one more sample),
    so the estimators that use one take it over the kept samples (`AdvantageInputs.kept_PG`)."""
    rewards_PG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    excluded_PG = torch.tensor([[x.excluded for x in g.samples] for g in groups], dtype=torch.bool)
    if excluded_PG.any():
        kept_PG = (~excluded_PG).float()
        fill_P1 = (rewards_PG * kept_PG).sum(1, keepdim=True) / kept_PG.sum(1, keepdim=True).clamp(min=1)
        rewards_PG = torch.where(excluded_PG, fill_P1, rewards_PG)
    metrics: dict[str, float] = {}
    if not s.advantage.shaping:
        return rewards_PG, metrics
    # the policy's own tokens: an episode's observations are not its length
    lengths_PG = torch.tensor([[x.sampled_tokens for x in g.samples] for g in groups])
    # correct: the first (correctness) reward function gave full marks, as in the accuracy metric
    correct_PG = torch.tensor([[is_correct(x, next(iter(x.reward_parts), "")) for x in g.samples] for g in groups])
    for name, kwargs in s.advantage.shaping:
        rewards_PG, m = SHAPING[name](rewards_PG, lengths_PG, correct_PG, s.loss.max_tokens, **kwargs)
        metrics |= m
    metrics["shaping/reward_mean"] = float(rewards_PG.mean())
    return rewards_PG, metrics


def compute_advantages(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    """advantages_PG from the groups' (shaped) rewards with the configured outcome estimator
    (without a KL in the reward, which needs the models; ``update_policy`` applies it)."""
    return outcome_advantages(groups, shaped_rewards(groups, s)[0], s)


def outcome_advantages(groups: list[Group], rewards_PG: torch.Tensor, s: UpdateSettings) -> torch.Tensor:
    """The outcome estimator on rewards_PG, with the step's `AdvantageInputs`."""
    if s.advantage.name not in ESTIMATORS:
        raise ValueError(f"advantage {s.advantage.name!r} is not an outcome estimator (rlvr.algos.ESTIMATORS): a "
                         "per-token one comes with its method's Credit (rlvr.train.methods.ppo)")
    estimator = ESTIMATORS[s.advantage.name]
    return estimator(rewards_PG, advantage_inputs(groups, s, greedy=wants_greedy(estimator)), **s.advantage.kwargs)


def advantage_inputs(groups: list[Group], s: UpdateSettings, greedy: bool = False) -> AdvantageInputs:
    """What an outcome estimator may read beyond the rewards (rlvr.algos.advantages.AdvantageInputs),
    from the groups; ``greedy``: each group's greedy_reward too (it must be there)."""
    names = sorted({k for g in groups for x in g.samples for k in x.reward_parts})
    parts = {k: torch.tensor([[float(x.reward_parts.get(k, 0.0)) for x in g.samples] for g in groups]) for k in names}
    # the parts that make up the reward: never a flag ("<name>/error", "<name>/excluded") or a
    # weight-0 diagnostic (an environment's "turns", a GRPO-RoC quality check)
    chosen = s.advantage.reward_components
    components = [k for k in names if (k in chosen if chosen else "/" not in k)]
    # a group without a pool is its own, over the samples with a verdict (an excluded one's reward is no score)
    pools = [[x.reward for x in g.samples if not x.excluded] or [0.0] if g.pool_rewards is None
             else list(g.pool_rewards) for g in groups]
    greedy_P = None
    if greedy:
        missing = [g.prompt[:40] for g in groups if g.greedy_reward is None]
        if missing:
            raise ValueError(f"advantage {s.advantage.name!r} needs each group's greedy_reward (the reward of a greedy "
                             f"completion; `rlvr train` adds it); missing for {missing[0]!r}")
        greedy_P = torch.tensor([float(g.greedy_reward) for g in groups])  # type: ignore[arg-type]
    kept_PG = torch.tensor([[not x.excluded for x in g.samples] for g in groups], dtype=torch.bool)
    return AdvantageInputs(parts=parts, components=tuple(components),
                           pool_mean_P=torch.tensor([statistics.fmean(p) for p in pools]),
                           pool_std_P=torch.tensor([statistics.stdev(p) if len(p) > 1 else 0.0 for p in pools]),
                           greedy_P=greedy_P, kept_PG=None if bool(kept_PG.all()) else kept_PG)


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


def check_turn_credit(cfg: RunConfig) -> None:
    """Turn credit computes its own advantages: refuse what it would ignore (run when a run opens)."""
    a = cfg.algo
    if a.credit == "turn" and (a.advantage != "grpo" or a.shaping or a.kl_placement == "reward" and a.kl_coef > 0):
        raise ValueError(TURN_CREDIT_ALONE)


def check_combination(s: UpdateSettings, per_token: bool, kl_in_reward: bool, summarised: bool) -> None:
    """Refuse what an update cannot train (a run's config refuses these earlier, with its own words)."""
    if kl_in_reward and summarised:
        raise ValueError("summarised episodes (env.summarize) train with outcome advantages: "
                         "kl_placement = \"reward\" is not supported with them")
    if s.advantage.turn_credit and (per_token or kl_in_reward or s.advantage.shaping or s.advantage.name != "grpo"):
        raise ValueError(TURN_CREDIT_ALONE)


def turn_credit(groups: list[Group], samples: list[Sample], owner: list[int], s: UpdateSettings) -> list[torch.Tensor]:
    """Per-token advantages from each group's turn rewards (rlvr.algos.turn_advantages): a token
    gets the advantage of the turn it belongs to (``Completion.turn_index``)."""
    per_episode: list[list[float]] = []
    for g in groups:
        if "turn_rewards" not in g.metadata:
            raise ValueError("algo.credit = \"turn\" needs multi-turn episodes (an [env] section): a group "
                             f"without turn rewards: {g.prompt[:60]!r}")
        per_episode += turn_advantages(g.metadata["turn_rewards"], gamma=s.advantage.turn_gamma)
    out = []
    for u, x in enumerate(samples):
        turns = per_episode[owner[u]]
        index = x.completion.turn_index or (0,) * len(x.completion.token_ids)
        # a summary sampled after the last turn has no return left to credit
        out.append(torch.tensor([turns[t] if t < len(turns) else 0.0 for t in index], dtype=torch.float32))
    return out
