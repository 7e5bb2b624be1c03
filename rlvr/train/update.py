"""One policy update from a step's scored groups: advantages, then epochs × mini-batches of the loss.

This is where the pieces from `rlvr.algos` meet: the advantage estimator, the policy loss, the KL
estimator and the loss aggregation are all looked up by name; nothing here is a formula.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Protocol

import torch
from transformers import PreTrainedModel

from rlvr.algos import CORRECTIONS, KL_ESTIMATORS, LOSSES, aggregate_loss, mismatch_metrics
from rlvr.algos.entropy_control import high_entropy_tokens
from rlvr.algos.inputs import LossInputs, StatefulLoss
from rlvr.train.advantages import (check_combination, compute_advantages, outcome_advantages, shaped_rewards,
                                   turn_credit, units)
from rlvr.train.batches import (collate, micro_batches, old_rows, prompt_sharing, sample_logprobs, score_certainty,
                                score_logprobs, token_rows)
from rlvr.train.inputs import SampleFields, sample_fields
from rlvr.train.learner import Learner
from rlvr.train.logprobs import packs_completions
from rlvr.train.parallel import all_reduce_sums, idle_passes, share, world
from rlvr.train.settings import (AdvantageSettings, KLSettings, LossSettings, Passes, UpdateSettings,
                                 settings_from_config)
from rlvr.types import Group, Sample

__all__ = ["AdvantageSettings", "Credit", "KLSettings", "LossSettings", "LossTerm", "Passes", "UpdateResult",
           "UpdateSettings", "collate", "compute_advantages", "score_certainty", "score_logprobs", "settings_from_config",
           "shaped_rewards", "update_policy"]


class LossTerm(Protocol):
    """A term of its own added to every optimizer step's gradient, beside the policy loss (on
    rank 0 of data-parallel learners): CHORD's SFT on demonstrations, DPH-RL's divergence on the
    initial policy's samples. `add` adds its metric sums to `sums` (keys starting with "_" are
    counts); `summarise` takes its own keys out of the update's summed `sums` and returns its metrics."""

    def add(self, learner: Learner, s: UpdateSettings, pad_token_id: int, device: torch.device,
            sums: dict[str, float]) -> None: ...

    def summarise(self, sums: dict[str, float]) -> dict[str, float]: ...


class Credit(Protocol):
    """Per-token advantages from a model trained beside the policy, in place of the outcome
    estimator: PPO's critic with GAE (rlvr.train.methods.ppo). The update calls `advantages` once,
    with the shaped rewards and, when the KL sits in the reward, each row's per-token KL to the
    reference (``kl_N``; else None); `backward` on every micro-batch it trains, which adds the
    model's own gradient and returns token-weighted metrics (its other sums go into `sums`, as a
    LossTerm's do); `step` after each optimizer step of the policy; `summarise` at the end. Its
    state is part of every checkpoint and reaches data-parallel ranks."""

    def advantages(self, groups: list[Group], samples: list[Sample], kept: set[int], rewards_PG: torch.Tensor,
                   kl_N: list[torch.Tensor] | None, s: UpdateSettings, pad_token_id: int) -> list[torch.Tensor]: ...

    def backward(self, batch: dict[str, torch.Tensor], micro: list[int], s: UpdateSettings,
                 totals: dict[str, float], sums: dict[str, float]) -> dict[str, torch.Tensor]: ...

    def step(self) -> None: ...

    def summarise(self, sums: dict[str, float]) -> dict[str, float]: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class Extras:
    """What an update takes beyond the groups and the settings (`update_policy`'s keywords), from
    the methods that need it (rlvr.train.methods)."""

    ref_model: PreTrainedModel | None = None
    credit: Credit | None = None
    """Per-token advantages in place of the outcome estimator (PPO's critic with GAE)."""
    loss_state: dict[str, float] | None = None
    terms: tuple[LossTerm, ...] = ()
    """Gradient terms of their own beside the policy loss (CHORD's SFT, DPH-RL's divergence)."""

    def keywords(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class UpdateResult:
    """What an update computed: its metrics, and per group of its input (in order) each sample's
    advantage (the token mean for per-token estimators) and why a sample had loss mask 0."""

    metrics: dict[str, float]
    advantages: tuple[tuple[float, ...], ...]
    masked: tuple[tuple[str | None, ...], ...]

    def outcomes(self, groups: Sequence[Group]) -> list[Group]:
        """``groups`` (the update's, or their leading part: a group it trained with demonstrations
        appended is still the policy's own group) as new Groups carrying their samples' advantages
        and mask reasons; for the samples log and the sampler."""
        return [replace(g, advantages=a[: len(g.samples)], masked=m[: len(g.samples)])
                for g, a, m in zip(groups, self.advantages, self.masked)]


# per-token metrics of the update (means over trained tokens)
_TOKEN_METRICS = ("entropy", "kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
                  "ratio_mean")


def update_policy(
    learner: Learner,
    groups: list[Group],
    s: UpdateSettings,
    *,
    pad_token_id: int,
    ref_model: PreTrainedModel | None = None,
    generator: torch.Generator | None = None,
    credit: Credit | None = None,
    loss_state: dict[str, float] | None = None,
    terms: Sequence[LossTerm] = (),
) -> UpdateResult:
    """Advantages from the groups' rewards, then the policy-gradient update; returns its metrics
    and each sample's advantage (`UpdateResult`); the groups are not changed. ``credit`` computes
    per-token advantages in place of the outcome estimator, training its own model alongside the
    policy (`Credit`: PPO's critic).
    ``loss_state`` is the dict a stateful loss (R²VPO's λ) keeps across steps; the caller owns it
    (and checkpoints it); None gives the loss a fresh one. ``terms`` add their own gradient to
    every optimizer step (`LossTerm`), beside the policy loss weighted by ``s.loss.policy_weight``.
    """
    episodes = [smp for g in groups for smp in g.samples]
    samples, owner = units(episodes)  # what is trained: one row per sample, or per segment of a summarised episode
    model = learner.model
    kl_in_loss = s.kl.in_loss and ref_model is not None
    # DAPO's overlong filtering: a completion cut off by the token budget is left out of the
    # loss altogether (numerator and the token/sequence counts), not treated as a failure;
    # so is a sample a reward excluded (returned None for), and every segment of such an episode.
    dropped_episodes = {i for i, smp in enumerate(episodes)
                        if smp.excluded or (s.loss.mask_truncated and smp.completion.finish_reason == "length")}
    dropped = {u for u, i in enumerate(owner) if i in dropped_episodes}
    kept = {u for u in range(len(samples)) if u not in dropped}
    batch, metrics = _advantages(learner, groups, samples, owner, kept, s, pad_token_id, ref_model, credit)
    # A sample with zero advantage adds exactly zero to the policy loss and its gradient, so it is
    # not run at all unless a KL or entropy term (or the critic) gives it a gradient of its own.
    # (GRPO groups whose rewards are all equal are common: 30-90% of groups late in a run.)
    needs_all = kl_in_loss or s.loss.entropy_coef != 0 or credit is not None
    trained = {i for i in kept if needs_all or bool(batch.advantages[i].any())}
    batch.old, batch.scored = _old_logprobs(model, groups, batch, owner, trained, s, pad_token_id)
    if kl_in_loss and batch.ref is None:
        batch.ref = score_logprobs(ref_model, samples, s, pad_token_id, trained)  # type: ignore[arg-type]
    elif not kl_in_loss:
        batch.ref = None  # scored for a KL in the reward: not a loss term
    batch.loss_state = {} if loss_state is None else loss_state

    sums, grad_norms = _optimise(learner, credit, batch, trained, dropped, s, generator, terms)
    metrics |= _summary(sums, grad_norms, kl_in_loss, [*terms, *([credit] if credit else [])])
    metrics["advantage_abs_mean"] = statistics.fmean(float(a.abs().mean()) if len(a) else 0.0
                                                     for a in batch.advantages) if samples else 0.0
    metrics["trained_fraction"] = len(trained) / len(samples)
    if s.loss.mask_truncated:
        metrics["masked_truncated_fraction"] = len(dropped) / len(samples)
    return _result(metrics, groups, batch.advantages, owner, dropped_episodes)


def _result(metrics: dict[str, float], groups: list[Group], advantages: list[torch.Tensor], owner: list[int],
            dropped: set[int]) -> UpdateResult:
    """Per group, each sample's advantage (the token mean over its rows) and why it had loss mask 0."""
    episodes = [smp for g in groups for smp in g.samples]
    mine: list[list[torch.Tensor]] = [[] for _ in episodes]
    for u, a in enumerate(advantages):
        mine[owner[u]].append(a)
    per_sample = iter([float(torch.cat(a).mean()) if sum(len(x) for x in a) else 0.0 for a in mine])
    reasons = iter([("excluded" if smp.excluded else "truncated") if i in dropped else None
                    for i, smp in enumerate(episodes)])
    return UpdateResult(metrics, tuple(tuple(next(per_sample) for _ in g.samples) for g in groups),
                        tuple(tuple(next(reasons) for _ in g.samples) for g in groups))


def _old_logprobs(model: PreTrainedModel, groups: list[Group], batch: _Batch, owner: list[int], trained: set[int],
                  s: UpdateSettings, pad_token_id: int) -> tuple[Sequence[torch.Tensor | None] | None, set[int]]:
    """The "old" policy's log-probs of the PPO ratio, per trained row (None: the current policy's,
    detached), and the rows whose old log-probs are the current policy's scored before the update.

    With one optimizer step per rollout batch the policy has not moved yet, so the old log-probs
    equal the current ones and the extra forward pass is skipped. A replayed group (rollout
    replay), or a stale one (asynchronous rollouts), was sampled by an older policy: the ratio is
    taken against its sampling log-probs, which importance-weights and clips its update. An expert
    demonstration (LUFFY) is trained against its own log-probs (0: π_expert taken as 1)."""
    samples, old = batch.samples, batch.old
    if old is None and s.epochs * s.mini_batches > 1:
        old = score_logprobs(model, samples, s, pad_token_id, trained)
    replayed_episodes = {i for i, (g, x) in enumerate((g, x) for g in groups for x in g.samples)
                         if g.replay_age is not None or g.staleness or x.off_policy}
    replayed = [u for u, i in enumerate(owner) if i in replayed_episodes]
    scored = set() if old is None else trained - set(replayed)
    if not replayed:
        return old, scored
    out: list[torch.Tensor | None] = list(old) if old is not None else [None] * len(samples)
    for i in replayed:
        out[i] = torch.tensor(samples[i].completion.logprobs, dtype=torch.float32)
    return out, scored


def _optimise(
    learner: Learner, credit: Credit | None, batch: _Batch, trained: set[int], dropped: set[int],
    s: UpdateSettings, generator: torch.Generator | None, terms: Sequence[LossTerm],
) -> tuple[dict[str, float], list[float]]:
    """epochs × mini-batches of optimizer steps; returns the summed metrics and the grad norms."""
    samples, pad_token_id = batch.samples, batch.pad_token_id
    loss = LOSSES[s.loss.name]
    stateful = loss if isinstance(loss, StatefulLoss) else None  # e.g. R²VPO's dual ascent on λ, after each step
    sums: dict[str, float] = defaultdict(float)
    grad_norms = []
    learner.model.train()
    for epoch in range(s.epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        size = len(samples) // s.mini_batches
        for k in range(s.mini_batches):
            # Before the first optimizer step the policy has not moved: a scored row's old log-probs
            # are its current ones, taken detached from this very forward pass rather than from the
            # scoring pass, whose micro-batching rounds differently. The ratio is then exactly 1,
            # as with one optimizer step per rollout batch; a loss with a kink at 1 (KL-Cov's
            # |log r|) would otherwise take its gradient's sign from that rounding.
            old = batch.old if epoch or k or batch.old is None else \
                [None if i in batch.scored else o for i, o in enumerate(batch.old)]
            mini = [i for i in order[k * size : (k + 1) * size] if i not in dropped]
            totals = {"total_tokens": float(sum(samples[i].completion.trainable() for i in mini)),
                      "total_seqs": float(len(mini))}
            # The totals count every sample of the mini-batch, skipped for zero advantage or
            # not: the gradient is the one of the full mini-batch.
            run = [i for i in mini if i in trained]
            step_sums: dict[str, float] = defaultdict(float)
            # data-parallel learners each take their share of the micro-batches (rlvr.train.parallel)
            micros = micro_batches(run, samples, s.passes.micro_batch_size, s.passes.micro_batch_tokens,
                                   prompt_sharing(learner.model, s), packs_completions(learner.model))
            for micro in share(micros):
                _accumulate(learner, credit, batch, old, micro, s, totals, step_sums)
            idle_passes(learner.model, len(micros), pad_token_id)  # sharded learners: as many passes on every rank
            if world()[0] == 0:
                for term in terms:
                    term.add(learner, s, pad_token_id, batch.device, step_sums)
            step_sums = defaultdict(float, all_reduce_sums(dict(step_sums)))
            grad_norms.append(learner.step())
            if credit is not None:
                credit.step()
            if stateful is not None and step_sums.get("_tokens"):
                means = {k: v / step_sums["_tokens"] for k, v in step_sums.items() if not k.startswith("_")}
                stateful.after_step(batch.loss_state, means, **s.loss.kwargs)
            for key, value in step_sums.items():
                sums[key] = max(sums.get(key, float("-inf")), value) if key.startswith("_max/") else sums[key] + value
    return sums, grad_norms


def _advantages(
    learner: Learner, groups: list[Group], samples: list[Sample], owner: list[int], kept: set[int],
    s: UpdateSettings, pad_token_id: int, ref_model: PreTrainedModel | None, credit: Credit | None,
) -> tuple[_Batch, dict[str, float]]:
    """Each kept row's per-token advantages, from its (shaped, possibly KL-penalised) reward; the
    rows of a summarised episode's segments share the episode's advantage.

    A KL in the reward needs the samples scored first (old policy and reference); those are kept
    in the batch so the update does not compute them again.
    """
    kl_in_reward = s.kl.in_reward and ref_model is not None
    check_combination(s, credit is not None, kl_in_reward, summarised=len(set(owner)) != len(samples))
    rewards_PG, metrics = shaped_rewards(groups, s)
    old = ref = None
    if kl_in_reward:  # the penalty is the old policy's KL to the reference, before any update
        old = score_logprobs(learner.model, samples, s, pad_token_id, kept)
        ref = score_logprobs(ref_model, samples, s, pad_token_id, kept)  # type: ignore[arg-type]
    kl_N = [torch.zeros(len(x.completion.token_ids)) for x in samples]
    if kl_in_reward:
        assert old is not None and ref is not None
        # per-sample values live on the CPU (token_rows takes them to the model's device); both
        # scores are 0 at tokens an environment injected, so the penalty is on the policy's own tokens
        kl_N = [KL_ESTIMATORS[s.kl.estimator](old[i], ref[i]).float().cpu() if i in kept else kl_N[i]
                for i in range(len(samples))]
        seq_kl_PG = torch.tensor([float(k.sum()) for k in kl_N]).view_as(rewards_PG)
        metrics["kl_reward"] = float(seq_kl_PG.flatten()[sorted(kept)].mean()) if kept else float("nan")
        metrics["kl_coef"] = s.kl.coef
        if credit is None:
            rewards_PG = rewards_PG - s.kl.coef * seq_kl_PG
    if credit is not None:
        advantages = credit.advantages(groups, samples, kept, rewards_PG, kl_N if kl_in_reward else None, s,
                                       pad_token_id)
    elif s.advantage.turn_credit:
        advantages = turn_credit(groups, samples, owner, s)
    else:
        advantages_B = outcome_advantages(groups, rewards_PG, s).flatten()
        advantages = [torch.full((len(x.completion.token_ids),), float(advantages_B[owner[u]]))
                      for u, x in enumerate(samples)]
    device = next(learner.model.parameters()).device
    fields = sample_fields(groups, samples, owner)
    if fields.kl_scale is not None and not (s.kl.in_loss and ref_model is not None):
        raise ValueError("the episodes' environment weights the KL term by turn (e.g. self_correct's first_kl), but "
                         "the update has no KL term in the loss: set algo.kl_coef > 0 (kl_placement = \"loss\")")
    return _Batch(samples, advantages, old, ref, fields, pad_token_id, device), metrics


def _summary(sums: dict[str, float], grad_norms: list[float], kl_in_loss: bool,
             parts: Sequence[LossTerm | Credit]) -> dict[str, float]:
    """The update's metrics from the summed per-micro-batch values (``parts``: the loss terms and
    the credit, each taking its own sums out)."""
    metrics: dict[str, float] = {}
    tokens, loss_sum = sums.pop("_tokens", 0.0), sums.pop("_loss", 0.0)
    for part in parts:
        metrics |= part.summarise(sums)
    maxima = {k.removeprefix("_max/"): sums.pop(k) for k in [k for k in sums if k.startswith("_max/")]}
    # token-weighted means over the trained tokens; NaN (null in metrics.jsonl) when none was trained
    names = set(sums) | {k for k in _TOKEN_METRICS if k != "kl" or kl_in_loss}
    metrics |= {k: sums[k] / tokens if tokens else float("nan") for k in sorted(names)}
    # means over optimizer steps
    metrics.update(loss=loss_sum / len(grad_norms), grad_norm=sum(grad_norms) / len(grad_norms))
    skipped = sum(not math.isfinite(g) for g in grad_norms)
    if skipped:  # steps the learner did not apply, their gradient not finite (Learner.step)
        metrics["skipped_optimizer_steps"] = float(skipped)
    return metrics | maxima


@dataclass
class _Batch:
    """Per-sample completion-token tensors of one update (None where not used)."""

    samples: list[Sample]
    advantages: list[torch.Tensor]
    old: Sequence[torch.Tensor | None] | None
    """Old-policy log-probs; None (all, or one sample's) = the current policy's, detached."""
    ref: list[torch.Tensor] | None
    fields: SampleFields
    """The loss inputs that come from the groups (correctness, demonstrations), per sample."""
    pad_token_id: int
    device: torch.device
    loss_state: dict[str, float] = field(default_factory=dict)
    scored: set[int] = field(default_factory=set)
    """The rows whose `old` is the current policy's, scored before the update."""


def policy_loss(s: UpdateSettings, x: LossInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """`algo.loss` per token, over the trained tokens, or with `algo.entropy.top` < 1 over the
    pass's high-entropy ("forking") tokens alone (`high_entropy_tokens`): the selection is the
    loss's mask, so a loss that takes a statistic over a row (GSPO's and GMPO's sequence ratio)
    takes it over the selected tokens and no other token gets a gradient (zeroing the loss after
    it was computed left GMPO's row value on every token), and the loss's own metrics are over
    the selected tokens. The aggregation's token counts stay those of every trained token."""
    top = s.loss.entropy_top
    selected_BT = x.mask if top >= 1.0 else high_entropy_tokens(x.need("entropy"), x.mask, top)
    loss_BT, metrics = LOSSES[s.loss.name](replace(x, mask=selected_BT), **s.loss.kwargs)
    return torch.where(selected_BT, loss_BT, 0.0), metrics


def _accumulate(learner: Learner, credit: Credit | None, b: _Batch, old: Sequence[torch.Tensor | None] | None,
                micro: list[int], s: UpdateSettings, totals: dict[str, float], sums: dict[str, float]) -> None:
    """Forward and backward one micro-batch; add its token-weighted metrics to `sums`."""
    batch = collate([b.samples[i] for i in micro], b.pad_token_id, b.device)
    x = _loss_inputs(learner, b, old, micro, batch, s)
    loss_BT, metrics = policy_loss(s, x)
    weights_BT, is_metrics = CORRECTIONS[s.loss.offpolicy](x, **s.loss.offpolicy_kwargs)
    loss_BT = _penalised(loss_BT * weights_BT, x, s, sums)
    ls = s.loss  # its policy_weight: e.g. CHORD's 1 − μ beside its μ·SFT LossTerm
    loss = aggregate_loss(loss_BT, x.mask, mode=ls.aggregation, max_tokens=ls.max_tokens, **totals) * ls.policy_weight
    loss.backward()
    metrics = {**metrics, **is_metrics, **mismatch_metrics(x.old, x.need("sampler"), x.mask)}
    if credit is not None:
        metrics |= credit.backward(batch, micro, s, totals, sums)
    _add(sums, metrics, x, float(loss.detach()))


def _add(sums: dict[str, float], metrics: dict[str, torch.Tensor], x: LossInputs, loss: float) -> None:
    """Add a micro-batch's loss, entropy and metrics, weighted by its trained tokens, to `sums`."""
    n = float(x.mask.sum())
    sums["_tokens"] += n
    sums["_loss"] += loss  # micro-batch aggregates sum to the mini-batch loss
    sums["entropy"] += float(x.need("entropy").detach()[x.mask].sum())
    for key, value in metrics.items():
        if key.endswith("_max"):  # maxima over the update, kept apart from the token-weighted sums
            sums["_max/" + key] = max(sums.get("_max/" + key, float("-inf")), float(value))
        else:
            sums[key] += float(value) * n


def _loss_inputs(learner: Learner, b: _Batch, old: Sequence[torch.Tensor | None] | None, micro: list[int],
                 batch: dict[str, torch.Tensor], s: UpdateSettings) -> LossInputs:
    """The micro-batch's `LossInputs`: the policy's log-probs and entropy from its forward pass,
    and every per-sample value of the update on the micro-batch's completion tokens (values sit
    on every completion token; the loss and its metrics see the trained ones, ``loss_mask``)."""
    rows, where_BT = [b.samples[i] for i in micro], batch["completion_mask"]
    logprobs_BT, entropy_BT = sample_logprobs(learner.model, rows, batch, s, b.pad_token_id)
    old_BT = logprobs_BT.detach() if old is None else old_rows(old, micro, logprobs_BT.detach(), where_BT)
    # The engine's own log-probs of what it sampled, against the learner's before this update
    # (a demonstration was not sampled by the engine: it counts as matching, weight 1).
    sampler_BT = token_rows([torch.tensor(x.completion.logprobs, dtype=torch.float32) for x in rows],
                            list(range(len(micro))), where_BT)
    demos_B = torch.tensor([x.off_policy for x in rows], device=where_BT.device)
    if demos_B.any():
        sampler_BT = torch.where(demos_B[:, None], old_BT, sampler_BT)
    fields = b.fields  # correctness, group accuracy, demonstrations: from the groups, per sample
    return LossInputs(
        logprobs_BT, old_BT, token_rows(b.advantages, micro, where_BT), batch["loss_mask"], sampler=sampler_BT,
        ref=None if b.ref is None else token_rows(b.ref, micro, where_BT), entropy=entropy_BT,
        kl_scale=None if fields.kl_scale is None else token_rows(fields.kl_scale, micro, where_BT),
        correct=token_rows(fields.correct, micro, where_BT),
        group_accuracy=token_rows(fields.group_accuracy, micro, where_BT),
        offpolicy=token_rows(fields.offpolicy, micro, where_BT), state=b.loss_state)


def _penalised(loss_BT: torch.Tensor, x: LossInputs, s: UpdateSettings, sums: dict[str, float]) -> torch.Tensor:
    """The per-token loss plus β·KL to the reference, when the batch has one, and minus the entropy
    bonus. The KL estimator gets π_old with the policy's own log-probs at masked positions: a ratio
    of 1 there (the ratio-weighted k3), never an overflow that 0 · inf would turn into NaN."""
    if x.ref is not None:
        kl_BT = KL_ESTIMATORS[s.kl.estimator](x.logprobs, x.ref, torch.where(x.mask, x.old, x.logprobs.detach()))
        loss_BT = loss_BT + s.kl.coef * (kl_BT if x.kl_scale is None else x.kl_scale * kl_BT)
        sums["kl"] += float(kl_BT.detach()[x.mask].sum())
    if s.loss.entropy_coef:
        loss_BT = loss_BT - s.loss.entropy_coef * x.need("entropy")
    return loss_BT
