"""The settings of a policy update: the algorithm's knobs, unpacked from the config by the loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from rlvr.algos.losses import ACTS_OFF_POLICY, LOSS_AGGREGATION
from rlvr.config import RunConfig
from rlvr.rewards import RewardFn


@dataclass(frozen=True)
class AdvantageSettings:
    """How rewards become advantages."""

    name: str = "grpo"
    """The estimator (rlvr.algos.ESTIMATORS), ``algo.advantage``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    shaping: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Length-based reward shaping, (name, kwargs) applied in order before the advantages."""
    credit: str = "episode"
    """"episode": every token of an episode gets its advantage; "turn": turn-level advantages from
    the environment's turn rewards (rlvr.algos.turn_advantages; episodes only)."""
    turn_gamma: float = 1.0
    reward_components: tuple[str, ...] = ()
    """The reward parts that make up the reward (reward functions of non-zero weight; "env", an
    environment's return), for BNPO's decomposition; () = every part that is not a flag
    ("<name>/error", "<name>/excluded", "<name>/no_value")."""

    @property
    def turn_credit(self) -> bool:
        """Advantages per turn from an environment's turn rewards, instead of one per episode."""
        return self.credit == "turn"


@dataclass(frozen=True)
class LossSettings:
    """The per-token objective: the policy loss, its off-policy correction, the entropy terms, the
    aggregation, and its weight beside a method's own loss terms."""

    name: str = "ppo_clip"
    """The policy loss (rlvr.algos.LOSSES), ``algo.loss``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    offpolicy: str = "none"
    """Correction between the engine's sampling log-probs and the learner's (rlvr.algos.CORRECTIONS)."""
    offpolicy_kwargs: dict[str, Any] = field(default_factory=dict)
    aggregation: str = "token-mean"
    """rlvr.algos.AGGREGATIONS; from a config, the loss's own where algo.aggregation is unset
    (settings_from_config; rlvr.algos.losses.LOSS_AGGREGATION), here the plain token mean."""
    max_tokens: int = 128
    """The generation budget: sampling.max_new_tokens, or an episode's env.max_total_tokens
    (the constant normaliser of "seq-mean-token-sum-norm", overlong shaping's L_max)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: leave completions cut off at max_tokens out of the loss."""
    entropy_coef: float = 0.0
    entropy_top: float = 1.0
    """The fraction of each forward pass's trained tokens, by highest entropy, that the policy loss
    trains (rlvr.algos.entropy_control.high_entropy_tokens; 1 = all)."""
    policy_weight: float = 1.0
    """Weight of the policy loss against the step's LossTerms (CHORD sets 1 − μ beside its μ·SFT term)."""


@dataclass(frozen=True)
class KLSettings:
    """The KL to the reference policy."""

    coef: float = 0.0
    estimator: str = "k3"
    placement: str = "loss"
    """"loss": β·KL per token in the loss (GRPO); "reward": -β·KL subtracted from the reward (PPO-RLHF)."""

    @property
    def in_loss(self) -> bool:
        """β·KL to the reference on every token of the loss."""
        return self.coef > 0 and self.placement == "loss"

    @property
    def in_reward(self) -> bool:
        """-β·KL to the reference subtracted from the reward before the advantages."""
        return self.coef > 0 and self.placement == "reward"


@dataclass(frozen=True)
class Passes:
    """How the learner's forward passes run: the micro-batches and the log-prob computation."""

    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    """Padded tokens per micro-batch at most (None = no cap)."""
    temperature: float = 1.0
    logprob_chunk: int = 256
    share_prompts: bool = True
    """Encode the prompt shared by several rows of a micro-batch once (rlvr.train.logprobs.
    shared_prompt_logprobs), and run its completions packed into as few rows as fit the longest
    (rlvr.train.logprobs.completion_lanes; SDPA attention): the same log-probs and gradient as one
    row per sample, to float rounding, for fewer tokens, in the micro-batches where that is cheaper
    (rlvr.train.batches.shares_prompts: a long prompt, or completions of unequal lengths). Off, or
    with activation checkpointing (which turns off the key/value cache it needs), every row runs
    its whole prompt."""


@dataclass(frozen=True)
class UpdateSettings:
    """The algorithm's knobs, unpacked from the config by the loop, in the four parts the update's
    stages read: the advantages, the loss, the KL, the forward passes; and how many optimizer
    steps a batch takes (epochs × mini-batches)."""

    advantage: AdvantageSettings = field(default_factory=AdvantageSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    kl: KLSettings = field(default_factory=KLSettings)
    passes: Passes = field(default_factory=Passes)
    epochs: int = 1
    mini_batches: int = 1


def outcome_settings(s: UpdateSettings, estimator: str) -> UpdateSettings:
    """`s` with the outcome estimator `estimator` and no kwargs: the outcome part of a mixed
    per-token advantage (on-policy distillation's, a process reward's)."""
    return replace(s, advantage=replace(s.advantage, name=estimator, kwargs={}))


def settings_from_config(cfg: RunConfig, rewards: list[RewardFn]) -> UpdateSettings:
    """The update settings a run's config gives."""
    a, s, tr = cfg.algo, cfg.sampling, cfg.train
    entropy = a.entropy_options()
    if a.loss in ACTS_OFF_POLICY and tr.epochs * tr.mini_batches == 1:
        logging.getLogger("rlvr.train").warning(
            "algo.loss = %r with one optimizer step per batch (train.epochs = train.mini_batches = 1): %s, so on "
            "fresh on-policy samples it trains as the plain policy gradient (it acts only on stale, replayed or "
            "expert rows); set train.mini_batches >= 2 to use it", a.loss, ACTS_OFF_POLICY[a.loss])
    return UpdateSettings(
        advantage=AdvantageSettings(
            name=a.advantage, kwargs=dict(a.advantage_kwargs),
            shaping=tuple((spec.fn, dict(spec.kwargs)) for spec in a.shaping), credit=a.credit,
            turn_gamma=a.turn_gamma,
            # the parts that make up the reward (BNPO's decomposition fits these), not flags or weight-0 diagnostics
            reward_components=("env",) if cfg.env.name else tuple(r.name for r in rewards if r.weight != 0)),
        loss=LossSettings(
            name=a.loss, kwargs=dict(a.loss_kwargs), offpolicy=a.offpolicy, offpolicy_kwargs=dict(a.offpolicy_kwargs),
            aggregation=a.aggregation or LOSS_AGGREGATION.get(a.loss, "token-mean"),
            max_tokens=cfg.env.max_total_tokens if cfg.env.name else s.max_new_tokens,
            mask_truncated=a.mask_truncated, entropy_coef=entropy.coef, entropy_top=entropy.top),
        kl=KLSettings(coef=a.kl_coef, estimator=a.kl_estimator, placement=a.kl_placement),
        passes=Passes(micro_batch_size=tr.micro_batch_size, micro_batch_tokens=tr.micro_batch_tokens,
                      temperature=s.temperature, logprob_chunk=tr.logprob_chunk),
        epochs=tr.epochs, mini_batches=tr.mini_batches,
    )
