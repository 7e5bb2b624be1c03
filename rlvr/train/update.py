"""One policy update from a step's scored groups: advantages, then epochs × mini-batches of the loss.

This is where the pieces from `rlvr.algos` meet: the advantage estimator, the policy loss, the KL
estimator and the loss aggregation are all looked up by name; nothing here is a formula.
"""

from __future__ import annotations

import dataclasses

import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.algos import (CORRECTIONS, DIVERGENCES, ESTIMATORS, KL_ESTIMATORS, LOSSES, SHAPING, aggregate_loss,
                        mismatch_metrics, turn_advantages)
from rlvr.algos.losses import STATE_UPDATES
from rlvr.algos.registry import loop_inputs
from rlvr.algos.supervised import sft_token_loss
from rlvr.train.critic import value_loss
from rlvr.rewards.intrinsic import token_certainty
from rlvr.train.learner import Learner
from rlvr.train.rollouts import is_correct
from rlvr.train.logprobs import token_budget_batches, token_logprobs
from rlvr.train.parallel import all_reduce_sums, share, world
from rlvr.types import Completion, Group, Sample


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
    stratum_key: str | None = None
    """The reward part whose value is each sample's stratum (the "stratified" estimator)."""
    reward_components: tuple[str, ...] = ()
    """The reward parts that make up the reward (reward functions of non-zero weight; "env", an
    environment's return), for BNPO's decomposition; () = every part that is not a flag
    ("<name>/error", "<name>/excluded")."""
    aggregation: str = "token-mean"
    max_tokens: int = 128
    """The generation budget: sampling.max_new_tokens, or an episode's env.max_total_tokens
    (the constant normaliser of "seq-mean-token-sum-norm", overlong shaping's L_max)."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    kl_placement: str = "loss"
    """"loss": β·KL per token in the loss (GRPO); "reward": -β·KL subtracted from the reward (PPO-RLHF)."""
    value_clip: float | None = 0.2
    """Clip of the critic's value loss (GAE only); None = plain squared error."""
    divergence: str = "none"
    """DPH-RL's divergence to the initial policy on stored samples (rlvr.algos.DIVERGENCES)."""
    divergence_coef: float = 0.05
    expert_coef: float = 0.0
    """CHORD's μ this step: the loss is (1 − μ)·RL + μ·SFT on the expert demonstrations (update_policy's expert)."""
    expert_weighting: str = "chord_phi"
    """The SFT term's token weight (rlvr.algos.supervised.SFT_WEIGHTINGS)."""
    entropy_coef: float = 0.0
    epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 8
    micro_batch_tokens: int | None = None
    """Padded tokens per micro-batch at most (None = no cap)."""
    temperature: float = 1.0
    logprob_chunk: int = 256


# per-token metrics of the update (means over trained tokens)
_TOKEN_METRICS = ("entropy", "kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
                  "ratio_mean")


def collate(samples: list[Sample], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows. ``completion_mask`` marks every completion token (where
    per-token values are placed); ``loss_mask`` the ones trained on: all of them except tokens an
    environment injected (``Completion.loss_mask`` 0)."""
    width = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    completion_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion.token_ids)
        ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion.token_ids)
        attention[i, : p + c] = 1
        completion_mask[i, p : p + c] = True
        own = s.completion.loss_mask
        loss_mask[i, p : p + c] = True if own is None else torch.tensor(own, dtype=torch.bool)
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device),
            "completion_mask": completion_mask.to(device), "loss_mask": loss_mask.to(device)}


def _micro_batches(indices: list[int], samples: list[Sample], size: int,
                   max_tokens: int | None = None) -> list[list[int]]:
    """At most ``size`` rows, and at most ``max_tokens`` padded tokens (rows × the longest row),
    per micro-batch; a row longer than that goes alone. Similar lengths go together: less
    padding. The totals passed to aggregate_loss keep the result independent of the cut.

    The token cap is what keeps memory bounded when rows are long (multi-turn episodes): the
    activations a backward pass keeps grow with the tokens in the micro-batch (about 1.1 MB a
    token on SmolLM2-135M in fp32, docs/LOG.md), so 16 rows of 1,000 tokens need some 18 GB."""
    ordered = sorted(indices, key=lambda i: samples[i].num_tokens)
    cuts = token_budget_batches([samples[i].num_tokens for i in ordered], max_tokens, size)
    return [[ordered[j] for j in cut] for cut in cuts]


@torch.no_grad()
def score_logprobs(
    model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """Per-sample log-probs of the completion tokens under `model` (old policy or reference);
    samples outside `which` are not scored (zeros: they are never trained on)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(model.parameters()).device
    for micro in _micro_batches(sorted(which), samples, s.micro_batch_size, s.micro_batch_tokens):
        batch = collate([samples[i] for i in micro], pad, device)
        lp_BT, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                                  temperature=s.temperature, chunk_size=s.logprob_chunk)
        for row, i in enumerate(micro):
            out[i] = lp_BT[row][batch["completion_mask"][row]]
    return out


@torch.no_grad()
def score_certainty(
    model: PreTrainedModel, samples: list[Sample], pad: int, *, temperature: float = 1.0, micro_batch_size: int = 8,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(self_certainty_N, negative_entropy_N): each sample's token means under `model`
    (rlvr.rewards.intrinsic.token_certainty), micro-batched like score_logprobs."""
    certainty, negative_entropy = torch.zeros(len(samples)), torch.zeros(len(samples))
    device = next(model.parameters()).device
    for micro in _micro_batches(list(range(len(samples))), samples, micro_batch_size):
        batch = collate([samples[i] for i in micro], pad, device)
        certainty[micro], negative_entropy[micro] = token_certainty(
            model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"], temperature=temperature,
            chunk_size=chunk_size)
    return certainty, negative_entropy


def _old_rows(old: Sequence[torch.Tensor | None], micro: list[int], current_BT: torch.Tensor,
              mask_BT: torch.Tensor) -> torch.Tensor:
    """The old policy's log-probs of a micro-batch; a sample without stored ones (None) takes the
    current policy's, detached (its first optimizer step on a fresh rollout)."""
    rows = {i: old[i] if old[i] is not None else current_BT[r][mask_BT[r]] for r, i in enumerate(micro)}
    return _rows(rows, micro, mask_BT)  # type: ignore[arg-type]


def _rows(per_sample: list[torch.Tensor], micro: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-sample completion values into the micro-batch's [B, T] layout."""
    values = torch.cat([per_sample[i] for i in micro])
    out = torch.zeros(mask_BT.shape, dtype=torch.promote_types(values.dtype, torch.float32), device=mask_BT.device)
    return out.masked_scatter(mask_BT, values.to(out.dtype))


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


def needs_greedy_baseline(advantage: str) -> bool:
    """Whether the estimator takes the reward of each prompt's greedy completion (ReMax)."""
    return "baseline_P" in loop_inputs(ESTIMATORS[advantage])


def compute_advantages(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    """advantages_PG from the groups' (shaped) rewards with the configured outcome estimator
    (without a KL in the reward, which needs the models; ``update_policy`` applies it)."""
    if "values_BT" in loop_inputs(ESTIMATORS[s.advantage]):
        raise ValueError(f"advantage {s.advantage!r} is per token and needs a critic: use update_policy")
    return _outcome_advantages(groups, shaped_rewards(groups, s)[0], s)


def _outcome_advantages(groups: list[Group], rewards_PG: torch.Tensor, s: UpdateSettings) -> torch.Tensor:
    """The outcome estimator on rewards_PG, with the inputs only the loop has filled in by name."""
    estimator = ESTIMATORS[s.advantage]
    inputs = {name: _PROVIDERS[name](groups, s) for name in loop_inputs(estimator)}
    return estimator(rewards_PG, **s.advantage_kwargs, **inputs)


def _greedy_baseline(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    missing = [g.prompt[:40] for g in groups if "greedy_reward" not in g.metadata]
    if missing:
        raise ValueError(f"advantage {s.advantage!r} needs each group's metadata['greedy_reward'] (the "
                         f"reward of a greedy completion; `rlvr train` adds it); missing for {missing[0]!r}")
    return torch.tensor([float(g.metadata["greedy_reward"]) for g in groups])


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
    """Every reward generated for each prompt: a pooling sampler's metadata['pool_rewards'], else the group."""
    return [list(g.metadata.get("pool_rewards", g.rewards)) for g in groups]


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
"""How the loop fills in each outcome estimator input of rlvr.algos.registry.LOOP_INPUTS."""


def update_policy(
    learner: Learner,
    groups: list[Group],
    s: UpdateSettings,
    *,
    pad_token_id: int,
    ref_model: PreTrainedModel | None = None,
    generator: torch.Generator | None = None,
    critic: Learner | None = None,
    loss_state: dict[str, float] | None = None,
    rehearsal: list[Sample] | None = None,
    expert: list[Sample] | None = None,
) -> dict[str, float]:
    """Advantages from the groups' rewards, then the policy-gradient update; returns metrics.

    Each group's ``metadata["advantages"]`` receives its samples' advantages (the token mean for
    per-token estimators), for the samples log. ``critic`` (a Learner around a
    ``rlvr.train.critic.Critic``) is needed by GAE and trained alongside the policy.
    ``loss_state`` is the dict a stateful loss (R²VPO's λ) keeps across steps; the caller owns it
    (and checkpoints it); None gives the loss a fresh one. ``rehearsal``: stored samples of the
    initial policy (``completion.logprobs`` = log π_0) for ``s.divergence``, added to every
    optimizer step's gradient. ``expert``: demonstrations for CHORD's SFT term, weighted by
    ``s.expert_coef`` (μ) in every optimizer step while the RL loss is weighted by 1 − μ.
    """
    episodes = [smp for g in groups for smp in g.samples]
    samples, owner = _units(episodes)  # what is trained: one row per sample, or per segment of a summarised episode
    model = learner.model
    kl_in_loss = s.kl_coef > 0 and s.kl_placement == "loss" and ref_model is not None
    # DAPO's overlong filtering: a completion cut off by the token budget is left out of the
    # loss altogether (numerator and the token/sequence counts), not treated as a failure;
    # so is a sample a reward excluded (returned None for), and every segment of such an episode.
    dropped_episodes = {i for i, smp in enumerate(episodes)
                        if smp.excluded or (s.mask_truncated and smp.completion.finish_reason == "length")}
    dropped = {u for u, i in enumerate(owner) if i in dropped_episodes}
    kept = {u for u in range(len(samples)) if u not in dropped}
    batch, metrics = _advantages(learner, groups, samples, owner, kept, s, pad_token_id, ref_model, critic)
    mine: list[list[torch.Tensor]] = [[] for _ in episodes]
    for u, a in enumerate(batch.advantages):
        mine[owner[u]].append(a)
    per_sample = iter([float(torch.cat(a).mean()) if sum(len(x) for x in a) else 0.0 for a in mine])
    mask_reasons = iter([("excluded" if smp.excluded else "truncated") if i in dropped_episodes else None
                         for i, smp in enumerate(episodes)])
    for g in groups:
        g.metadata["advantages"] = [next(per_sample) for _ in g.samples]
        g.metadata["masked"] = [next(mask_reasons) for _ in g.samples]  # why a sample had loss mask 0

    # A sample with zero advantage adds exactly zero to the policy loss and its gradient, so it is
    # not run at all unless a KL or entropy term (or the critic) gives it a gradient of its own.
    # (GRPO groups whose rewards are all equal are common: 30-90% of groups late in a run.)
    needs_all = kl_in_loss or s.entropy_coef != 0 or batch.values is not None
    trained = {i for i in kept if needs_all or bool(batch.advantages[i].any())}
    # With one optimizer step per rollout batch the policy has not moved yet, so the old
    # log-probs equal the current ones (detached) and the extra forward pass is skipped.
    if batch.old is None and s.epochs * s.mini_batches > 1:
        batch.old = score_logprobs(model, samples, s, pad_token_id, trained)
    # A replayed group (rollout replay), or a stale one (asynchronous rollouts), was sampled by an
    # older policy: the PPO ratio is taken against its sampling log-probs, which importance-weights
    # and clips its update.
    # An expert demonstration (LUFFY) is trained against its own log-probs (0: π_expert taken as 1).
    replayed_episodes = {i for i, (g, x) in enumerate((g, x) for g in groups for x in g.samples)
                         if g.metadata.get("replayed") or g.metadata.get("stale") or x.off_policy}
    replayed = [u for u, i in enumerate(owner) if i in replayed_episodes]
    if replayed:
        old: list[torch.Tensor | None] = list(batch.old) if batch.old is not None else [None] * len(samples)
        for i in replayed:
            old[i] = torch.tensor(samples[i].completion.logprobs, dtype=torch.float32)
        batch.old = old
    if kl_in_loss and batch.ref is None:
        batch.ref = score_logprobs(ref_model, samples, s, pad_token_id, trained)  # type: ignore[arg-type]
    elif not kl_in_loss:
        batch.ref = None  # scored for a KL in the reward: not a loss term
    batch.loss_rows = _loss_rows(groups, samples, owner, loop_inputs(LOSSES[s.loss]))
    batch.loss_state = {} if loss_state is None else loss_state

    sums, grad_norms, critic_norms = _optimise(learner, critic, batch, trained, dropped, s, pad_token_id,
                                               generator, rehearsal, expert)
    metrics |= _summary(sums, grad_norms, critic_norms, kl_in_loss)
    metrics["advantage_abs_mean"] = statistics.fmean(float(a.abs().mean()) if len(a) else 0.0
                                                     for a in batch.advantages) if samples else 0.0
    metrics["trained_fraction"] = len(trained) / len(samples)
    if s.mask_truncated:
        metrics["masked_truncated_fraction"] = len(dropped) / len(samples)
    return metrics


def _optimise(
    learner: Learner, critic: Learner | None, batch: _Batch, trained: set[int], dropped: set[int],
    s: UpdateSettings, pad_token_id: int, generator: torch.Generator | None, rehearsal: list[Sample] | None,
    expert: list[Sample] | None = None,
) -> tuple[dict[str, float], list[float], list[float]]:
    """epochs × mini-batches of optimizer steps; returns the summed metrics and the grad norms."""
    samples, device = batch.samples, next(learner.model.parameters()).device
    sums: dict[str, float] = defaultdict(float)
    grad_norms, critic_norms = [], []
    learner.model.train()
    for _ in range(s.epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        size = len(samples) // s.mini_batches
        for k in range(s.mini_batches):
            mini = [i for i in order[k * size : (k + 1) * size] if i not in dropped]
            totals = {"total_tokens": float(sum(samples[i].completion.trainable() for i in mini)),
                      "total_seqs": float(len(mini))}
            # The totals count every sample of the mini-batch, skipped for zero advantage or
            # not: the gradient is the one of the full mini-batch.
            run = [i for i in mini if i in trained]
            step_sums: dict[str, float] = defaultdict(float)
            # data-parallel learners each take their share of the micro-batches (rlvr.train.parallel)
            for micro in share(_micro_batches(run, samples, s.micro_batch_size, s.micro_batch_tokens)):
                _accumulate(learner, critic, batch, micro, s, totals, pad_token_id, device, step_sums)
            if rehearsal and s.divergence != "none" and world()[0] == 0:
                _rehearse(learner, rehearsal, s, pad_token_id, device, step_sums)
            if expert and s.expert_coef and world()[0] == 0:
                _imitate(learner, expert, s, pad_token_id, device, step_sums)
            step_sums = defaultdict(float, all_reduce_sums(dict(step_sums)))
            grad_norms.append(learner.step())
            if critic is not None:
                critic_norms.append(critic.step())
            if s.loss in STATE_UPDATES and step_sums.get("_tokens"):  # e.g. R²VPO's dual ascent on λ
                means = {k: v / step_sums["_tokens"] for k, v in step_sums.items() if not k.startswith("_")}
                STATE_UPDATES[s.loss](batch.loss_state, means, **s.loss_kwargs)
            for key, value in step_sums.items():
                sums[key] = max(sums.get(key, float("-inf")), value) if key.startswith("_max/") else sums[key] + value
    return sums, grad_norms, critic_norms


def _advantages(
    learner: Learner, groups: list[Group], samples: list[Sample], owner: list[int], kept: set[int],
    s: UpdateSettings, pad_token_id: int, ref_model: PreTrainedModel | None, critic: Learner | None,
) -> tuple[_Batch, dict[str, float]]:
    """Each kept row's per-token advantages, from its (shaped, possibly KL-penalised) reward; the
    rows of a summarised episode's segments share the episode's advantage.

    A KL in the reward needs the samples scored first (old policy and reference), and GAE the
    critic's values; those are kept in the batch so the update does not compute them again.
    """
    estimator = ESTIMATORS[s.advantage]
    token_level = "values_BT" in loop_inputs(estimator)
    if token_level and critic is None:
        raise ValueError(f"advantage {s.advantage!r} needs a critic (rlvr train builds one; pass critic=...)")
    kl_in_reward = s.kl_coef > 0 and s.kl_placement == "reward" and ref_model is not None
    if (token_level or kl_in_reward) and len(set(owner)) != len(samples):
        raise ValueError("summarised episodes (env.summarize_at) train with outcome advantages: "
                         "advantage = \"gae\" and kl_placement = \"reward\" are not supported with them")
    if s.credit == "turn" and (token_level or kl_in_reward or s.shaping or s.advantage != "grpo"):
        raise ValueError("algo.credit = \"turn\" computes its own group-relative advantages from the turn "
                         "rewards: use it with advantage = \"grpo\", no shaping and no KL in the reward")
    rewards_PG, metrics = shaped_rewards(groups, s)
    old = ref = values = returns = None
    if kl_in_reward:  # the penalty is the old policy's KL to the reference, before any update
        old = score_logprobs(learner.model, samples, s, pad_token_id, kept)
        ref = score_logprobs(ref_model, samples, s, pad_token_id, kept)  # type: ignore[arg-type]
    kl_N = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    if kl_in_reward:
        assert old is not None and ref is not None
        kl_N = [KL_ESTIMATORS[s.kl_estimator](old[i], ref[i]) if i in kept else kl_N[i] for i in range(len(samples))]
        seq_kl_PG = torch.tensor([float(k.sum()) for k in kl_N]).view_as(rewards_PG)
        metrics["kl_reward"] = float(seq_kl_PG.flatten()[sorted(kept)].mean()) if kept else float("nan")
        metrics["kl_coef"] = s.kl_coef
        if not token_level:
            rewards_PG = rewards_PG - s.kl_coef * seq_kl_PG
    if token_level:
        assert critic is not None
        values = _score_values(critic.model, samples, s, pad_token_id, kept)
        turn_rewards = [tr for g in groups for tr in g.metadata.get("turn_rewards", [None] * len(g.samples))]
        advantages, returns = _token_advantages(samples, rewards_PG, kl_N, values, kept, s, turn_rewards)
    elif s.credit == "turn":
        advantages = _turn_credit(groups, samples, owner, s)
    else:
        advantages_B = _outcome_advantages(groups, rewards_PG, s).flatten()
        advantages = [torch.full((len(x.completion.token_ids),), float(advantages_B[owner[u]]))
                      for u, x in enumerate(samples)]
    return _Batch(samples, advantages, old, ref, values, returns), metrics


def _summary(sums: dict[str, float], grad_norms: list[float], critic_norms: list[float],
             kl_in_loss: bool) -> dict[str, float]:
    """The update's metrics from the summed per-micro-batch values."""
    metrics: dict[str, float] = {}
    tokens, loss_sum = sums.pop("_tokens", 0.0), sums.pop("loss", 0.0)
    div_tokens = sums.pop("_divergence_tokens", 0.0)
    expert_tokens = sums.pop("_expert_tokens", 0.0)
    if expert_tokens:  # CHORD: the demonstrations' mean negative log-likelihood
        metrics["expert/nll"] = sums.pop("expert_nll") / expert_tokens
    for key in [k for k in sums if k.startswith("divergence")]:  # means over the rehearsal tokens
        metrics[key] = sums.pop(key) / div_tokens
    value_loss_sum = sums.pop("value_loss", 0.0)
    maxima = {k.removeprefix("_max/"): sums.pop(k) for k in [k for k in sums if k.startswith("_max/")]}
    # token-weighted means over the trained tokens; NaN (null in metrics.jsonl) when none was trained
    names = set(sums) | {k for k in _TOKEN_METRICS if k != "kl" or kl_in_loss}
    metrics |= {k: sums[k] / tokens if tokens else float("nan") for k in sorted(names)}
    metrics["loss"] = loss_sum / len(grad_norms)  # mean over optimizer steps
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    if critic_norms:
        metrics["value_loss"] = value_loss_sum / len(critic_norms)
        metrics["critic_grad_norm"] = sum(critic_norms) / len(critic_norms)
    return metrics | maxima


@dataclass
class _Batch:
    """Per-sample completion-token tensors of one update (None where not used)."""

    samples: list[Sample]
    advantages: list[torch.Tensor]
    old: Sequence[torch.Tensor | None] | None
    """Old-policy log-probs; None (all, or one sample's) = the current policy's, detached."""
    ref: list[torch.Tensor] | None
    values: list[torch.Tensor] | None
    returns: list[torch.Tensor] | None
    loss_rows: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    """Per-token loss inputs the loop fills in (rlvr.algos.registry.LOOP_INPUTS), per sample."""
    loss_state: dict[str, float] = field(default_factory=dict)


def _loss_rows(groups: list[Group], samples: list[Sample], owner: list[int],
               names: list[str]) -> dict[str, list[torch.Tensor]]:
    """The per-sample values behind a loss's loop inputs, repeated over each completion token of
    each trained row (``samples``, whose ``owner`` is the group sample they belong to)."""
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


def _units(episodes: list[Sample]) -> tuple[list[Sample], list[int]]:
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


def _turn_credit(groups: list[Group], samples: list[Sample], owner: list[int], s: UpdateSettings) -> list[torch.Tensor]:
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
def _score_values(
    critic: torch.nn.Module, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """The critic's values of each sample's completion tokens (zeros outside `which`)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(critic.parameters()).device
    for micro in _micro_batches(sorted(which), samples, s.micro_batch_size, s.micro_batch_tokens):
        batch = collate([samples[i] for i in micro], pad, device)
        values_BT = critic(batch["input_ids"], batch["attention_mask"])
        for row, i in enumerate(micro):
            out[i] = values_BT[row][batch["completion_mask"][row]].float().cpu()
    return out


def _token_advantages(
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
        rewards_BT[r, :n] = -s.kl_coef * kl_N[i] if s.kl_placement == "reward" else 0.0
        for position, reward in _reward_positions(samples[i].completion, float(rewards_B[i]), turn_rewards[i]):
            rewards_BT[r, position] += reward
        values_BT[r, :n] = values[i]
    advantages = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    returns = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    if rows:
        adv_BT, ret_BT = ESTIMATORS[s.advantage](rewards_BT, mask_BT, values_BT=values_BT, **s.advantage_kwargs)
        for r, i in enumerate(rows):
            advantages[i], returns[i] = adv_BT[r][mask_BT[r]], ret_BT[r][mask_BT[r]]
    return advantages, returns


def _reward_positions(completion: Completion, total: float,
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


def _rehearse(learner: Learner, rehearsal: list[Sample], s: UpdateSettings, pad_token_id: int,
              device: torch.device, sums: dict[str, float]) -> None:
    """Add divergence_coef · (token mean of the divergence over the rehearsal samples) to the gradient."""
    total = float(sum(x.completion.trainable() for x in rehearsal))
    for micro in _micro_batches(list(range(len(rehearsal))), rehearsal, s.micro_batch_size, s.micro_batch_tokens):
        batch = collate([rehearsal[i] for i in micro], pad_token_id, device)
        mask_BT, where_BT = batch["loss_mask"], batch["completion_mask"]
        logprobs_BT, _ = token_logprobs(learner.model, batch["input_ids"], batch["attention_mask"], where_BT,
                                        temperature=s.temperature, chunk_size=s.logprob_chunk)
        init_BT = _rows([torch.tensor(rehearsal[i].completion.logprobs, dtype=torch.float32) for i in micro],
                        list(range(len(micro))), where_BT)
        div_BT, div_metrics = DIVERGENCES[s.divergence](logprobs_BT, init_BT, mask_BT)
        div = aggregate_loss(div_BT, mask_BT, mode="token-mean", total_tokens=total)
        (s.divergence_coef * div).backward()
        n = float(mask_BT.sum())
        sums["_divergence_tokens"] += n
        sums["divergence"] += float(div.detach()) * total  # the micro-batch's share of the token sum
        for key, value in div_metrics.items():
            sums[key] += float(value) * n


def imitation_step(learner: Learner, demos: list[Sample], s: UpdateSettings, *, pad_token_id: int) -> dict[str, float]:
    """One optimizer step of plain SFT (token-mean NLL) on `demos`: ReLIFT's interleaved fine-tuning."""
    sums: dict[str, float] = defaultdict(float)
    learner.model.train()
    plain = dataclasses.replace(s, expert_coef=1.0, expert_weighting="none")
    _imitate(learner, demos, plain, pad_token_id, next(learner.model.parameters()).device, sums)
    grad_norm = learner.step()
    return {"expert/sft_nll": sums["expert_nll"] / sums["_expert_tokens"], "expert/sft_grad_norm": grad_norm}


def _imitate(learner: Learner, expert: list[Sample], s: UpdateSettings, pad_token_id: int,
             device: torch.device, sums: dict[str, float]) -> None:
    """Add expert_coef · (token mean of the weighted SFT loss over the demonstrations) to the gradient (CHORD)."""
    total = float(sum(x.completion.trainable() for x in expert))
    for micro in _micro_batches(list(range(len(expert))), expert, s.micro_batch_size, s.micro_batch_tokens):
        batch = collate([expert[i] for i in micro], pad_token_id, device)
        mask_BT = batch["loss_mask"]
        logprobs_BT, _ = token_logprobs(learner.model, batch["input_ids"], batch["attention_mask"],
                                        batch["completion_mask"], temperature=s.temperature, chunk_size=s.logprob_chunk)
        sft_BT = sft_token_loss(logprobs_BT, mask_BT, weighting=s.expert_weighting)
        (s.expert_coef * aggregate_loss(sft_BT, mask_BT, mode="token-mean", total_tokens=total)).backward()
        sums["_expert_tokens"] += float(mask_BT.sum())
        sums["expert_nll"] += float(-(logprobs_BT.detach() * mask_BT).sum())


def _accumulate(
    learner: Learner,
    critic: Learner | None,
    b: _Batch,
    micro: list[int],
    s: UpdateSettings,
    totals: dict[str, float],
    pad_token_id: int,
    device: torch.device,
    sums: dict[str, float],
) -> None:
    """Forward and backward one micro-batch; add its token-weighted metrics to `sums`."""
    batch = collate([b.samples[i] for i in micro], pad_token_id, device)
    # per-token values sit on every completion token; the loss and its metrics see the trained ones
    mask_BT, where_BT = batch["loss_mask"], batch["completion_mask"]
    logprobs_BT, entropy_BT = token_logprobs(learner.model, batch["input_ids"], batch["attention_mask"], where_BT,
                                             temperature=s.temperature, chunk_size=s.logprob_chunk)
    old_BT = logprobs_BT.detach() if b.old is None else _old_rows(b.old, micro, logprobs_BT.detach(), where_BT)
    adv_BT = _rows(b.advantages, micro, where_BT)
    inputs: dict[str, Any] = {name: _rows(rows, micro, where_BT) for name, rows in b.loss_rows.items()}
    if "loss_state" in loop_inputs(LOSSES[s.loss]):
        inputs["loss_state"] = b.loss_state
    loss_BT, loss_metrics = LOSSES[s.loss](logprobs_BT, old_BT, adv_BT, mask_BT, **s.loss_kwargs, **inputs)
    # The engine's own log-probs of what it sampled, against the learner's before this update.
    # (a demonstration was not sampled by the engine: it counts as matching, weight 1)
    sampler_BT = _rows([torch.tensor(b.samples[i].completion.logprobs, dtype=torch.float32) for i in micro],
                       list(range(len(micro))), where_BT)
    demos = torch.tensor([b.samples[i].off_policy for i in micro], device=where_BT.device)
    if demos.any():
        sampler_BT = torch.where(demos[:, None], old_BT, sampler_BT)
    weights_BT, is_metrics = CORRECTIONS[s.offpolicy](old_BT, sampler_BT, mask_BT, **s.offpolicy_kwargs)
    loss_BT = loss_BT * weights_BT
    loss_metrics = {**loss_metrics, **is_metrics, **mismatch_metrics(old_BT, sampler_BT, mask_BT)}
    if b.ref is not None:
        kl_BT = KL_ESTIMATORS[s.kl_estimator](logprobs_BT, _rows(b.ref, micro, where_BT))
        loss_BT = loss_BT + s.kl_coef * kl_BT
        sums["kl"] += float(kl_BT.detach()[mask_BT].sum())
    if s.entropy_coef:
        loss_BT = loss_BT - s.entropy_coef * entropy_BT
    loss = aggregate_loss(loss_BT, mask_BT, mode=s.aggregation, max_tokens=s.max_tokens, **totals)
    if s.expert_coef:  # CHORD: (1 − μ) of the RL loss; the SFT term is added by _imitate
        loss = loss * (1 - s.expert_coef)
    loss.backward()
    n = float(mask_BT.sum())
    if critic is not None and b.values is not None and b.returns is not None:
        values_BT = critic.model(batch["input_ids"], batch["attention_mask"])
        v_loss_BT, v_metrics = value_loss(values_BT, _rows(b.values, micro, where_BT),
                                          _rows(b.returns, micro, where_BT), mask_BT, clip=s.value_clip)
        v_loss = aggregate_loss(v_loss_BT, mask_BT, mode=s.aggregation, max_tokens=s.max_tokens, **totals)
        v_loss.backward()
        sums["value_loss"] += float(v_loss.detach())
        loss_metrics |= v_metrics
    sums["_tokens"] += n
    sums["loss"] += float(loss.detach())  # micro-batch aggregates sum to the mini-batch loss
    sums["entropy"] += float(entropy_BT.detach()[mask_BT].sum())
    for key, value in loss_metrics.items():
        if key.endswith("_max"):  # maxima over the update, kept apart from the token-weighted sums
            sums["_max/" + key] = max(sums.get("_max/" + key, float("-inf")), float(value))
        else:
            sums[key] += float(value) * n
