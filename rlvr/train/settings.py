"""The settings of a policy update: the algorithm's knobs, unpacked from the config by the loop."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from rlvr.algos.losses import ACTS_OFF_POLICY, LOSS_AGGREGATION
from rlvr.config import RunConfig
from rlvr.rewards import RewardFn


@dataclass(frozen=True)
class UpdateSettings:
    """The algorithm's knobs, unpacked from the config by the loop."""

    advantage: str = "grpo"
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    loss: str = "ppo_clip"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    offpolicy: str = "none"
    """Correction between the engine's sampling log-probs and the learner's (rlvr.algos.CORRECTIONS)."""
    offpolicy_kwargs: dict[str, Any] = field(default_factory=dict)
    shaping: tuple[tuple[str, dict[str, Any]], ...] = ()
    """Length-based reward shaping, (name, kwargs) applied in order before the advantages."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: leave completions cut off at max_tokens out of the loss."""
    credit: str = "episode"
    """"episode": every token of an episode gets its advantage; "turn": turn-level advantages from
    the environment's turn rewards (rlvr.algos.turn_advantages; episodes only)."""
    turn_gamma: float = 1.0
    reward_components: tuple[str, ...] = ()
    """The reward parts that make up the reward (reward functions of non-zero weight; "env", an
    environment's return), for BNPO's decomposition; () = every part that is not a flag
    ("<name>/error", "<name>/excluded")."""
    aggregation: str = "token-mean"
    """rlvr.algos.AGGREGATIONS; from a config, the loss's own where algo.aggregation is unset
    (settings_from_config; rlvr.algos.losses.LOSS_AGGREGATION), here the plain token mean."""
    max_tokens: int = 128
    """The generation budget: sampling.max_new_tokens, or an episode's env.max_total_tokens
    (the constant normaliser of "seq-mean-token-sum-norm", overlong shaping's L_max)."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_placement: str = "loss"
    """"loss": β·KL per token in the loss (GRPO); "reward": -β·KL subtracted from the reward (PPO-RLHF)."""
    policy_weight: float = 1.0
    """Weight of the policy loss against the step's LossTerms (CHORD sets 1 − μ beside its μ·SFT term)."""
    entropy_coef: float = 0.0
    entropy_top: float = 1.0
    """The fraction of each forward pass's trained tokens, by highest entropy, that the policy loss
    trains (rlvr.algos.entropy_control.high_entropy_tokens; 1 = all)."""
    epochs: int = 1
    mini_batches: int = 1
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

    @property
    def kl_in_loss(self) -> bool:
        """β·KL to the reference on every token of the loss."""
        return self.kl_coef > 0 and self.kl_placement == "loss"

    @property
    def kl_in_reward(self) -> bool:
        """-β·KL to the reference subtracted from the reward before the advantages."""
        return self.kl_coef > 0 and self.kl_placement == "reward"

    @property
    def turn_credit(self) -> bool:
        """Advantages per turn from an environment's turn rewards, instead of one per episode."""
        return self.credit == "turn"


def settings_from_config(cfg: RunConfig, rewards: list[RewardFn]) -> UpdateSettings:
    """The update settings a run's config gives."""
    a, s, tr = cfg.algo, cfg.sampling, cfg.train
    if a.loss in ACTS_OFF_POLICY and tr.epochs * tr.mini_batches == 1:
        logging.getLogger("rlvr.train").warning(
            "algo.loss = %r with one optimizer step per batch (train.epochs = train.mini_batches = 1): %s, so on "
            "fresh on-policy samples it trains as the plain policy gradient (it acts only on stale, replayed or "
            "expert rows); set train.mini_batches >= 2 to use it", a.loss, ACTS_OFF_POLICY[a.loss])
    return UpdateSettings(
        advantage=a.advantage, advantage_kwargs=dict(a.advantage_kwargs),
        loss=a.loss, loss_kwargs=dict(a.loss_kwargs), offpolicy=a.offpolicy,
        offpolicy_kwargs=dict(a.offpolicy_kwargs),
        shaping=tuple((spec.fn, dict(spec.kwargs)) for spec in a.shaping), mask_truncated=a.mask_truncated,
        credit=a.credit, turn_gamma=a.turn_gamma,
        # the parts that make up the reward (BNPO's decomposition fits these), not flags or weight-0 diagnostics
        reward_components=("env",) if cfg.env.name else tuple(r.name for r in rewards if r.weight != 0),
        aggregation=a.aggregation or LOSS_AGGREGATION.get(a.loss, "token-mean"),
        max_tokens=cfg.env.max_total_tokens if cfg.env.name else s.max_new_tokens,
        kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, kl_placement=a.kl_placement,
        entropy_coef=a.entropy_options().coef, entropy_top=a.entropy_options().top,
        epochs=tr.epochs, mini_batches=tr.mini_batches, micro_batch_size=tr.micro_batch_size,
        micro_batch_tokens=tr.micro_batch_tokens, temperature=s.temperature, logprob_chunk=tr.logprob_chunk,
    )
