"""Advantage estimators: outcome estimators (one reward and one advantage per completion), GAE
(per token, with a critic: PPO's, composed by rlvr.train.methods.ppo) and turn-level credit.

Shapes: ``_P`` prompts, ``_G`` completions sampled per prompt (the group), ``_K`` reward parts.

Every outcome estimator is called the same way, ``fn(rewards_PG, inputs, **kwargs)``: ``inputs``
(`AdvantageInputs`) carries what an estimator may read beyond the rewards, filled in by the
training loop for every step; ``kwargs`` are its config knobs (``algo.advantage_kwargs``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import Tensor


@dataclass(frozen=True)
class AdvantageInputs:
    """What an outcome estimator may read beyond ``rewards_PG``; the training loop fills it in
    for every step (rlvr.train.advantages.advantage_inputs). Each field says who reads it."""

    parts: Mapping[str, Tensor] = field(default_factory=dict)
    """Each reward function's raw value, [P, G] by name, weight-0 diagnostics included (e.g. an
    environment's "tool_calls"); 0 where a sample lacks it (a reward routed to other sources).
    ``stratified`` reads its strata here."""
    components: tuple[str, ...] = ()
    """The names in ``parts`` that make up the reward (``bnpo``'s decomposition)."""
    pool_mean_P: Tensor | None = None
    """Mean reward over every response generated for each prompt (``Group.pool_rewards``; a group
    without a pool is its own); ``global_pool``'s baseline. None: the group's own."""
    pool_std_P: Tensor | None = None
    """Unbiased std of the same pool."""
    greedy_P: Tensor | None = None
    """The reward of each prompt's greedy completion (``remax``'s baseline); the loop samples it
    only for an estimator marked with `greedy_baseline`."""
    kept_PG: Tensor | None = None
    """True where a sample's reward counts, False where a reward gave no verdict (None: all count).
    ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp`` and ``lite_ppo`` take their group and batch
    statistics over the kept samples only, and ``global_pool``'s own-group pool holds only them
    (``pool_mean_P``); the other estimators see an excluded sample at its
    group's kept mean (rlvr.train.advantages.shaped_rewards), which keeps a mean baseline but
    narrows a standard deviation. An excluded sample's own advantage is never trained on."""

    def components_KPG(self) -> Tensor:
        """The reward components' values stacked, [K, P, G]."""
        if not self.components:
            raise ValueError(f"no reward component among the reward parts {sorted(self.parts)}")
        return torch.stack([self.parts[k].float() for k in self.components])


NO_INPUTS = AdvantageInputs()
"""Inputs of an estimator called on rewards alone."""

_F = TypeVar("_F", bound=Callable[..., Any])


def greedy_baseline(fn: _F) -> _F:
    """Mark an estimator that reads ``inputs.greedy_P``: the loop then samples one greedy
    completion per prompt before the update (rlvr.train.methods.remax)."""
    fn.greedy_baseline = True  # type: ignore[attr-defined]
    return fn


def wants_greedy(fn: Callable[..., Any]) -> bool:
    """Whether the estimator is marked with `greedy_baseline`."""
    return bool(getattr(fn, "greedy_baseline", False))


def group_advantages(
    rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """GRPO group-relative advantages.

    A_pg = (r_pg - mean_g r_pg) / (std_g r_pg + eps)   if normalize_std
    A_pg =  r_pg - mean_g r_pg                          otherwise

    GRPO: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
    Language Models", arXiv:2402.03300. ``std_g`` is the unbiased sample standard deviation
    over the group (divisor G - 1, ``torch.std``'s default), as in DeepSeekMath's reference
    implementation and TRL.

    ``normalize_std=False`` is Dr.GRPO: Liu et al., "Understanding R1-Zero-Like Training: A
    Critical Perspective", arXiv:2503.20783. Dividing by std up-weights groups whose rewards
    barely differ (questions that are nearly always or nearly never solved).

    A group whose rewards are all equal, including a group of one (G = 1, where the sample
    std is undefined), has exactly zero advantage: it carries no ranking signal.

    ``eps`` is 1e-6 as in verl's ``compute_grpo_outcome_advantage``; TRL's ``GRPOTrainer`` adds
    1e-4, which damps groups whose rewards differ by less than ~1e-3 where 1e-6 scales them to
    unit size (``advantage_kwargs = {eps = 1e-4}`` gives TRL's advantages; docs/algorithms.md).
    With ``inputs.kept_PG``, the mean and std are over each group's kept samples (k of them,
    divisor k - 1), as if the others had not been sampled.

    Args:
        rewards_PG: float rewards, [P, G].
    Returns:
        advantages_PG: [P, G].
    """
    _check_PG(rewards_PG)
    kept_PG = _kept(rewards_PG, inputs)
    n_P1 = kept_PG.sum(dim=1, keepdim=True)
    advantages_PG = rewards_PG - (rewards_PG * kept_PG).sum(dim=1, keepdim=True) / n_P1.clamp(min=1)
    if normalize_std:
        # unbiased: divisor k - 1 (G - 1 with every sample kept, torch.std's default)
        var_P1 = (advantages_PG**2 * kept_PG).sum(dim=1, keepdim=True) / (n_P1 - 1).clamp(min=1)
        advantages_PG = torch.where(n_P1 > 1, advantages_PG / (var_P1.sqrt() + eps), advantages_PG)
    # Rounding in the mean can leave ~1e-8 residues in a constant group, which division by
    # (0 + eps) would blow up to O(1); pin such groups, and groups of one, to exactly zero.
    alone_P1 = n_P1 <= 1
    constant_P1 = _constant_groups(rewards_PG, inputs.kept_PG)
    return torch.where(constant_P1 | alone_P1, torch.zeros_like(advantages_PG), advantages_PG)


def dr_grpo_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS) -> Tensor:
    """Dr.GRPO: A_pg = r_pg - mean_g r_pg, no division by the group std.

    Liu et al., "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    The same as ``grpo`` with ``normalize_std=False``; a name of its own so recipes read plainly.
    """
    return group_advantages(rewards_PG, inputs, normalize_std=False)


def rloo_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS) -> Tensor:
    """REINFORCE leave-one-out: each sample's baseline is the mean reward of the other G - 1.

    A_pg = r_pg - 1/(G-1) Σ_{j≠g} r_pj = G/(G-1) · (r_pg - mean_g r_pg)

    Kool et al., "Buy 4 REINFORCE Samples, Get a Baseline for Free!" (ICLR 2019 workshop);
    Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
    Human Feedback in LLMs", arXiv:2402.14740. The baseline does not depend on the sample
    itself, so the gradient estimate stays unbiased. G = 1 has no other sample: advantage 0.
    """
    _check_PG(rewards_PG)
    n_P1 = _kept(rewards_PG, inputs).sum(dim=1, keepdim=True)  # G, or a group's kept samples
    centered_PG = group_advantages(rewards_PG, inputs, normalize_std=False)
    return torch.where(n_P1 > 1, centered_PG * (n_P1 / (n_P1 - 1).clamp(min=1)), torch.zeros_like(rewards_PG))


def reinforce_pp_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, group_baseline: bool = True,
                            eps: float = 1e-6) -> Tensor:
    """REINFORCE++: advantages whitened over the whole batch instead of within each group.

    x_pg = r_pg - mean_g r_pg   (group_baseline, "REINFORCE++-baseline")   or   x_pg = r_pg
    A_pg = (x_pg - mean_batch x) / (std_batch x + eps)

    Hu et al., "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and
    Reward Models", arXiv:2501.03262 (the baseline variant is the one for G > 1 samples per
    prompt). std is the unbiased sample std over all P·G values. With ``group_baseline`` a group
    whose rewards are all equal keeps advantage exactly 0; without it, it does not (plain
    REINFORCE++ is meant for one sample per prompt). The paper also subtracts a per-token KL from
    the reward; rlvr's KL terms are separate (``algo.kl_coef``).
    """
    _check_PG(rewards_PG)
    x_PG = group_advantages(rewards_PG, inputs, normalize_std=False) if group_baseline else rewards_PG
    kept_PG = _kept(rewards_PG, inputs)
    if kept_PG.sum() < 2:
        return torch.zeros_like(x_PG)
    mean, std = _batch_mean_std(x_PG, kept_PG)
    out_PG = (x_PG - mean) / (std + eps)
    if group_baseline:
        out_PG = torch.where(_constant_groups(rewards_PG, inputs.kept_PG), torch.zeros_like(out_PG), out_PG)
    return out_PG


def lite_ppo_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, eps: float = 1e-6) -> Tensor:
    """LitePPO: the group's mean as baseline, the batch's reward std as scale.

    A_pg = (r_pg - mean_g r_pg) / (std_batch r + eps)

    Liu et al., "Part I: Tricks or Traps? A Deep Dive into RL for LLM Reasoning",
    arXiv:2508.08221 (group-level mean, batch-level std; with token-level loss aggregation it beat
    GRPO and DAPO there). std is the unbiased sample std of all P·G rewards. Unlike GRPO, a
    group with nearly equal rewards is not blown up to unit scale.
    """
    _check_PG(rewards_PG)
    centered_PG = group_advantages(rewards_PG, inputs, normalize_std=False)
    kept_PG = _kept(rewards_PG, inputs)
    if kept_PG.sum() < 2:
        return centered_PG
    return centered_PG / (_batch_mean_std(rewards_PG, kept_PG)[1] + eps)


def _kept(rewards_PG: Tensor, inputs: AdvantageInputs) -> Tensor:
    """1.0 where a sample's reward counts (`AdvantageInputs.kept_PG`), else 0.0."""
    return torch.ones_like(rewards_PG) if inputs.kept_PG is None else inputs.kept_PG.to(rewards_PG.dtype)


def _batch_mean_std(x_PG: Tensor, kept_PG: Tensor) -> tuple[Tensor, Tensor]:
    """The mean and unbiased std of x over the kept entries of the whole batch (at least two)."""
    n = kept_PG.sum()
    mean = (x_PG * kept_PG).sum() / n
    return mean, (((x_PG - mean) ** 2 * kept_PG).sum() / (n - 1)).sqrt()


def bnpo_advantages(
    rewards_PG: Tensor,
    inputs: AdvantageInputs = NO_INPUTS,
    *,
    min_reward: float = 0.0,
    max_reward: float = 1.0,
    max_weight: float = 1e6,
    decompose: bool = False,
) -> Tensor:
    """BNPO: the group-mean baseline, scaled by the inverse of a Beta density fitted to the batch.

    s_pg = (r_pg - min_reward) / (max_reward - min_reward)        rewards mapped to [0, 1]
    p_p  = mean_g s_pg                                             (0 when G = 1)
    m, v = mean and unbiased variance of p_p over the batch's prompts
    a = (m(1 - m)/v - 1)·m,  b = (m(1 - m)/v - 1)·(1 - m)          method of moments
    α = max(1, 1 + a/3),  β = max(1, 1 + b/3)
    A_pg = min(1 / Beta(p_p; α, β), max_weight) · (s_pg - p_p)

    Xiao et al., "BNPO: Beta Normalization Policy Optimization", arXiv:2506.02864; the fit and
    the clamp follow the authors' code (changyi7231/BNPO, ``compute_bnpo_outcome_advantage``).
    With binary rewards, α = β = 1 is REINFORCE with a group-mean baseline, and α = β = 3/2
    weights by 1/√(p(1-p)) like GRPO. With one prompt, or prompts that all have the same mean
    (v = 0), there is nothing to fit and α = β = 1 is used. Name clash: TRL's and ms-swift's
    ``loss_type="bnpo"`` is a loss aggregation, unrelated to this estimator.

    ``decompose = True`` is the paper's advantage decomposition for rewards made of several
    (binary) parts, e.g. correctness and format: each reward function's raw values
    (``inputs.components_KPG()``, one slice per reward component) get their own fit
    and advantage, and the advantage is their mean over the K parts. The weighted total reward is
    then not used; every part must lie in [min_reward, max_reward].
    """
    _check_PG(rewards_PG)
    if max_reward <= min_reward:
        raise ValueError(f"max_reward must exceed min_reward, got [{min_reward}, {max_reward}]")
    if not decompose:
        return _bnpo_one(rewards_PG, min_reward, max_reward, max_weight, "reward")
    reward_parts_KPG = inputs.components_KPG()
    if reward_parts_KPG.shape[1:] != rewards_PG.shape:
        raise ValueError(f"bnpo decompose=True needs reward components of shape [{rewards_PG.shape[0]}, "
                         f"{rewards_PG.shape[1]}] (inputs.parts), got {tuple(reward_parts_KPG.shape[1:])}")
    parts = [_bnpo_one(part_PG, min_reward, max_reward, max_weight, f"reward part {k}")
             for k, part_PG in enumerate(reward_parts_KPG)]
    return torch.stack(parts).mean(0)


def _bnpo_one(rewards_PG: Tensor, min_reward: float, max_reward: float, max_weight: float, what: str) -> Tensor:
    scores_PG = (rewards_PG.double() - min_reward) / (max_reward - min_reward)
    if scores_PG.min() < 0 or scores_PG.max() > 1:
        raise ValueError(
            f"BNPO needs each {what} inside [min_reward, max_reward] = [{min_reward}, {max_reward}]; "
            f"got [{float(rewards_PG.min())}, {float(rewards_PG.max())}]; set algo.advantage_kwargs"
        )
    if scores_PG.shape[1] > 1:
        p_P1 = scores_PG.mean(dim=1, keepdim=True)
    else:
        p_P1 = torch.zeros_like(scores_PG)
    alpha = beta = torch.tensor(1.0, dtype=torch.float64)
    if p_P1.shape[0] > 1 and p_P1.var() > 0:
        m, v = p_P1.mean(), p_P1.var()
        common = m * (1 - m) / v - 1
        alpha = torch.clamp(1 + common * m / 3, min=1.0)
        beta = torch.clamp(1 + common * (1 - m) / 3, min=1.0)
    density_P1 = torch.distributions.Beta(alpha, beta).log_prob(p_P1.clamp(1e-12, 1 - 1e-12)).exp()
    weight_P1 = torch.clamp(1 / density_P1, max=max_weight)
    advantages_PG = weight_P1 * (scores_PG - p_P1)
    if scores_PG.shape[1] > 1:  # a constant group has no signal (G = 1 has no baseline at all)
        advantages_PG = torch.where(_constant_groups(rewards_PG), torch.zeros_like(advantages_PG), advantages_PG)
    return advantages_PG.to(rewards_PG.dtype)


@greedy_baseline
def remax_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS) -> Tensor:
    """ReMax: each prompt's baseline is the reward of its greedy completion.

    A_pg = r_pg - r(x_p, ŷ_p),   ŷ_p = the greedy (temperature 0) completion of prompt p

    Li et al., "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for
    Aligning Large Language Models", arXiv:2310.10505. The training loop samples and scores the
    greedy completion itself for an estimator marked `greedy_baseline`, as this one is (one extra
    greedy sample per prompt, logged as ``greedy_reward``), into ``inputs.greedy_P``. Unlike the group
    baselines, a group whose samples all differ from the greedy answer's reward has signal,
    which is what makes ReMax work with G = 1.
    """
    _check_PG(rewards_PG)
    baseline_P = inputs.greedy_P
    if baseline_P is None or baseline_P.shape != rewards_PG.shape[:1]:
        got = None if baseline_P is None else tuple(baseline_P.shape)
        raise ValueError(f"remax needs inputs.greedy_P, each prompt's greedy reward: [P] = [{rewards_PG.shape[0]}], "
                         f"got {got}")
    return rewards_PG - baseline_P.to(rewards_PG.dtype)[:, None]


def stratified_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, stratum: str,
                          alpha: float = 0.5, eps: float = 1e-6) -> Tensor:
    """Stratified Advantage Normalization (SAN), blended with GRPO's group normalisation.

    Within prompt p, the samples of stratum k (those with strata_PG[p, g] = k, the reward part
    named ``stratum``: ``inputs.parts[stratum]``) are compared only
    with each other:
        A_SAN(pg) = (r_pg - mean_k r) / (std_k r + eps)          over the stratum's samples
        A_pg      = alpha · A_SAN(pg) + (1 - alpha) · A_GRPO(pg)

    Zhu et al., "Stratified GRPO: Handling Structural Heterogeneity in Reinforcement Learning of
    LLM Search Agents", arXiv:2510.06214. A search agent's trajectories differ in structure (how
    many searches it made); comparing a one-search answer with a five-search one against a single
    baseline adds the "cross-stratum bias" (mean_k r - mean r) to every advantage of the stratum.
    The paper blends SAN with the global estimator for finite-sample stability; its default
    alpha was not found in public text, so alpha = 0.5 is rlvr's choice (alpha = 1 is pure SAN,
    alpha = 0 is grpo). std is the unbiased sample std, as in ``grpo``; a stratum of one sample, or
    one whose rewards are equal, has A_SAN = 0. Strata are per prompt: equal ids in different
    prompts are unrelated. In training, ``algo.advantage_kwargs = {stratum = "tool_calls"}`` names
    the reward function (a weight-0 one can compute e.g. the number of tool calls).
    """
    _check_PG(rewards_PG)
    if stratum not in inputs.parts:
        raise ValueError(f"stratified: stratum {stratum!r} is not a reward of this run "
                         f"(rewards: {', '.join(sorted(inputs.parts)) or 'none'})")
    strata_PG = inputs.parts[stratum]
    if strata_PG.shape != rewards_PG.shape:
        raise ValueError(f"strata_PG must match rewards_PG {tuple(rewards_PG.shape)}, got {tuple(strata_PG.shape)}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    same_GG = strata_PG[:, :, None] == strata_PG[:, None, :]  # [P, G, G]: g and h share a stratum
    count_PG = same_GG.sum(-1).to(rewards_PG.dtype)
    mean_PG = (same_GG * rewards_PG[:, None, :]).sum(-1) / count_PG
    sq_dev_PG = (same_GG * (rewards_PG[:, None, :] - mean_PG[:, :, None]) ** 2).sum(-1)
    std_PG = torch.sqrt(sq_dev_PG / (count_PG - 1).clamp(min=1))
    san_PG = (rewards_PG - mean_PG) / (std_PG + eps)
    # a stratum whose rewards are all equal (including one of a single sample) has no signal
    equal_PG = (same_GG & (rewards_PG[:, :, None] != rewards_PG[:, None, :])).sum(-1) == 0
    san_PG = torch.where(equal_PG, torch.zeros_like(san_PG), san_PG)
    return alpha * san_PG + (1.0 - alpha) * group_advantages(rewards_PG, eps=eps)


def global_pool_advantages(
    rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, normalize_std: bool = True, eps: float = 1e-6
) -> Tensor:
    """Baseline (and scale) from every response generated for the prompt, not only the kept group.

    A_pg = (r_pg - mean_pool(p)) / (std_pool(p) + eps)    (without the division if not normalize_std)

    Reinforce-Ada (Xiong et al., "Reinforce-Ada: An Adaptive Sampling Framework for
    Reinforce-Style LLM Training", arXiv:2510.04996; ``global_stat_est`` in RLHFlow/Reinforce-Ada):
    an adaptive sampler draws responses in rounds until a prompt has enough signal, then
    down-samples to a fixed group with both rewards present. The group's own mean is then a
    biased estimate of the prompt's pass rate (it was chosen to be balanced); the pool of all
    rounds is not. ``inputs.pool_mean_P`` / ``inputs.pool_std_P`` come from each group's
    ``Group.pool_rewards`` (set by a pooling rollout strategy); a group without it is its own pool,
    which makes this estimator ``grpo``. A pool of one response has std 0; a pool whose rewards
    are all equal gives exactly zero advantage to every sample.
    """
    _check_PG(rewards_PG)
    pool_mean_P, pool_std_P = inputs.pool_mean_P, inputs.pool_std_P
    if pool_mean_P is None or pool_std_P is None:  # every group is its own pool
        group_size = rewards_PG.shape[1]
        pool_mean_P = rewards_PG.mean(1)
        pool_std_P = rewards_PG.std(1) if group_size > 1 else torch.zeros_like(pool_mean_P)
    for name, t in (("pool_mean_P", pool_mean_P), ("pool_std_P", pool_std_P)):
        if t.shape != rewards_PG.shape[:1]:
            raise ValueError(f"{name} must be [P] = [{rewards_PG.shape[0]}], got {tuple(t.shape)}")
    advantages_PG = rewards_PG - pool_mean_P.to(rewards_PG.dtype)[:, None]
    if normalize_std:
        advantages_PG = advantages_PG / (pool_std_P.to(rewards_PG.dtype)[:, None] + eps)
    flat_P1 = (pool_std_P == 0)[:, None] & (rewards_PG == pool_mean_P.to(rewards_PG.dtype)[:, None])
    return torch.where(flat_P1, torch.zeros_like(advantages_PG), advantages_PG)


def gae_advantages(
    token_rewards_BT: Tensor, mask_BT: Tensor, *, values_BT: Tensor, gamma: float = 1.0, lam: float = 0.95,
    whiten: bool = True, eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over completion tokens, for PPO with a learned critic.

    δ_t = r_t + γ V_{t'} - V_t,   A_t = δ_t + γλ A_{t'},   returns_t = A_t + V_t

    where t' is the next trained token of the row (V and A are 0 after the last one). Schulman et
    al., "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
    arXiv:1506.02438; as used for LMs in Ouyang et al., arXiv:2203.02155 (γ = 1, λ = 0.95 is the
    usual RLHF setting). Positions where ``mask_BT`` is False (padding, tokens an environment
    injected) are skipped: their reward is ignored and the recursion runs straight across them.
    ``whiten`` then shifts and scales the advantages to mean 0, std 1 over all trained tokens of
    the batch (the returns, the critic's targets, are not whitened).

    Returns (advantages_BT, returns_BT), both 0 at masked positions. ``values_BT`` is the critic's
    estimate, filled in by the loop; ``token_rewards_BT`` carries the outcome reward on each
    row's last token (and -β·KL on every token when the KL sits in the reward).
    """
    if not (0.0 <= gamma <= 1.0 and 0.0 <= lam <= 1.0):
        raise ValueError(f"need gamma and lam in [0, 1], got {gamma}, {lam}")
    mask_BT = mask_BT.bool()
    rewards_BT = torch.where(mask_BT, token_rewards_BT, torch.zeros_like(token_rewards_BT))
    values_BT = torch.where(mask_BT, values_BT.detach(), torch.zeros_like(rewards_BT))
    advantages_BT = torch.zeros_like(rewards_BT)
    next_value_B = torch.zeros_like(rewards_BT[:, 0])
    running_B = torch.zeros_like(next_value_B)
    for t in reversed(range(rewards_BT.shape[1])):
        m_B = mask_BT[:, t]
        gae_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t] + gamma * lam * running_B
        running_B = torch.where(m_B, gae_B, running_B)
        next_value_B = torch.where(m_B, values_BT[:, t], next_value_B)
        advantages_BT[:, t] = torch.where(m_B, gae_B, torch.zeros_like(gae_B))
    returns_BT = advantages_BT + values_BT
    if whiten and mask_BT.sum() > 1:
        picked = advantages_BT[mask_BT]
        advantages_BT = torch.where(mask_BT, (advantages_BT - picked.mean()) / (picked.std() + eps),
                                    torch.zeros_like(advantages_BT))
    return advantages_BT, returns_BT


def turn_advantages(turn_rewards: Sequence[Sequence[float]], *, gamma: float = 1.0,
                    normalize_std: bool = True, eps: float = 1e-6) -> list[list[float]]:
    """Turn-level credit for one group of G multi-turn episodes: each turn's tokens get the
    group-relative advantage of the return that follows the turn, against the episodes that also
    reached that turn.

    R_it = Σ_{u ≥ t} γ^(u−t) r_iu                           (return-to-go from turn t)
    A_it = (R_it − mean_{j∈S_t} R_jt) / (std_{j∈S_t} R_jt + eps)   S_t = episodes with a turn t

    std is the unbiased sample std, as in ``grpo``; ``normalize_std=False`` leaves it out. A turn
    that one episode alone reached, or whose returns are all equal, gets 0. With γ = 1 every
    episode's turn 0 gets exactly GRPO's advantage of its return, so with rewards only at the end
    this differs from GRPO only in later turns, whose baseline is the episodes that got that far;
    a reward paid mid-episode (a tool call that ran) credits that turn and the ones before it,
    not the ones after.

    The per-turn-index baseline is rlvr's simple form of turn-level credit assignment; compare
    MT-GRPO (Zeng et al., "Reinforcing Multi-Turn Reasoning in LLM Agents via Turn-Level Credit
    Assignment", arXiv:2505.11821), which adds group-normalised turn and outcome advantages, and
    GiGPO (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training",
    arXiv:2505.10978), which groups steps by identical states.

    Args:
        turn_rewards: the G episodes' rewards, one per turn (lengths may differ).
    Returns:
        advantages per episode and turn, the same shape.
    """
    returns = []
    for rewards in turn_rewards:
        running, back = 0.0, []
        for r in reversed(rewards):
            running = float(r) + gamma * running
            back.append(running)
        returns.append(back[::-1])
    out = [[0.0] * len(r) for r in returns]
    for t in range(max((len(r) for r in returns), default=0)):
        who = [i for i, r in enumerate(returns) if len(r) > t]
        values = torch.tensor([returns[i][t] for i in who], dtype=torch.float64)
        if len(who) < 2 or bool((values == values[0]).all()):
            continue
        centred = values - values.mean()
        if normalize_std:
            centred = centred / (values.std() + eps)
        for i, a in zip(who, centred.tolist()):
            out[i][t] = a
    return out


def rft_advantages(rewards_PG: Tensor, inputs: AdvantageInputs = NO_INPUTS, *, threshold: float | None = 1.0,
                   top_k: int = 0) -> Tensor:
    """Rejection sampling as advantages: 1 for each kept sample, 0 for the rest.

    Kept: reward >= ``threshold`` (None = no threshold) and, with ``top_k`` > 0, among the k
    highest rewards of its group (ties broken by order). With ``algo.loss = "pg"`` the update is
    −A · log π on the kept samples, i.e. supervised fine-tuning on what the reward accepted, and
    the rejected ones are skipped. Sampling from the current policy each step makes this:
    - rejection-sampling fine-tuning (RFT; Yuan et al., "Scaling Relationship on Learning
      Mathematical Reasoning with Large Language Models", arXiv:2308.01825);
    - reward-ranked fine-tuning (RAFT, ``top_k = 1``; Dong et al., arXiv:2304.06767);
    - expert iteration, and ReST's Improve step (Gulcehre et al., "Reinforced Self-Training",
      arXiv:2308.08998), whose rising thresholds are successive runs with a higher
      ``threshold``, and whose several passes over a grown set are ``train.epochs``.
    """
    _check_PG(rewards_PG)
    kept_PG = torch.ones_like(rewards_PG, dtype=torch.bool) if threshold is None else rewards_PG >= threshold
    if top_k > 0:
        order_PG = torch.argsort(-rewards_PG, dim=1, stable=True)
        rank_PG = torch.empty_like(order_PG)
        rank_PG.scatter_(1, order_PG, torch.arange(rewards_PG.shape[1]).expand_as(order_PG).contiguous())
        kept_PG &= rank_PG < top_k
    return kept_PG.to(rewards_PG.dtype)


def _check_PG(rewards_PG: Tensor) -> None:
    if rewards_PG.ndim != 2:
        raise ValueError(f"rewards_PG must be [P, G], got shape {tuple(rewards_PG.shape)}")


def _constant_groups(rewards_PG: Tensor, kept_PG: Tensor | None = None) -> Tensor:
    """[P, 1] True where every reward of the group is equal (every kept one, with ``kept_PG``: an
    excluded sample's filled-in mean can differ from them in the last bit)."""
    if kept_PG is None:
        return (rewards_PG == rewards_PG[:, :1]).all(dim=1, keepdim=True)
    kept = kept_PG.bool()
    first_P1 = rewards_PG.gather(1, kept.float().argmax(dim=1, keepdim=True))  # a kept one, where there is any
    return ((rewards_PG == first_P1) | ~kept).all(dim=1, keepdim=True)


ESTIMATORS: dict[str, Callable[..., Any]] = {
    "grpo": group_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "lite_ppo": lite_ppo_advantages,
    "bnpo": bnpo_advantages,
    "remax": remax_advantages,
    "stratified": stratified_advantages,
    "global_pool": global_pool_advantages,
    "rft": rft_advantages,
}
"""Outcome estimators: ``fn(rewards_PG, inputs, **kwargs) -> advantages_PG``. GAE is per token
and needs a critic: PPO's module composes it (rlvr.train.methods.ppo; ``algo.advantage = "gae"``)."""


def check_outcome(name: str) -> None:
    """A mix's outcome estimator (on-policy distillation's, a process reward's) must be one of
    ESTIMATORS."""
    if name not in ESTIMATORS:
        raise ValueError(f"outcome {name!r} is not an outcome estimator ({', '.join(sorted(ESTIMATORS))})")

GROUP_BASELINES: frozenset[str] = frozenset({"grpo", "dr_grpo", "rloo", "lite_ppo", "stratified"})
"""Estimators whose baseline is the other completions of the prompt: a config refuses them with
algo.group_size = 1 (every advantage would be 0)."""
