"""One policy update from a step's scored groups: advantages, then epochs × mini-batches of the loss.

This is where the pieces from `rlvr.algos` meet: the advantage estimator, the policy loss, the KL
estimator and the loss aggregation are all looked up by name; nothing here is a formula.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.algos import CORRECTIONS, ESTIMATORS, KL_ESTIMATORS, LOSSES, SHAPING, aggregate_loss, mismatch_metrics
from rlvr.train.learner import Learner
from rlvr.train.rollouts import is_correct
from rlvr.train.logprobs import token_logprobs
from rlvr.types import Group, Sample


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
    mask_truncated: bool = False
    """DAPO's overlong filtering: leave completions cut off at max_tokens out of the loss."""
    """Length-based reward shaping, (name, kwargs) applied in order before the advantages."""
    aggregation: str = "token-mean"
    max_tokens: int = 128
    """Constant normaliser for "seq-mean-token-sum-norm" (the generation budget)."""
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    epochs: int = 1
    mini_batches: int = 1
    micro_batch_size: int = 8
    temperature: float = 1.0
    logprob_chunk: int = 256


# per-token metrics of the update (means over trained tokens)
_TOKEN_METRICS = ("entropy", "kl", "clip_fraction", "clip_fraction_low", "clip_fraction_high", "dual_clip_fraction",
                  "ratio_mean")


def collate(samples: list[Sample], pad_token_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-padded prompt+completion rows; loss_mask marks the completion tokens."""
    width = max(s.num_tokens for s in samples)
    ids = torch.full((len(samples), width), pad_token_id, dtype=torch.long)
    attention = torch.zeros((len(samples), width), dtype=torch.long)
    loss_mask = torch.zeros((len(samples), width), dtype=torch.bool)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion.token_ids)
        ids[i, : p + c] = torch.tensor(s.prompt_ids + s.completion.token_ids)
        attention[i, : p + c] = 1
        loss_mask[i, p : p + c] = True
    return {"input_ids": ids.to(device), "attention_mask": attention.to(device), "loss_mask": loss_mask.to(device)}


def _micro_batches(indices: list[int], samples: list[Sample], size: int) -> list[list[int]]:
    # Similar lengths together: less padding. The totals passed to aggregate_loss keep the result
    # independent of how the mini-batch is cut.
    ordered = sorted(indices, key=lambda i: samples[i].num_tokens)
    return [ordered[i : i + size] for i in range(0, len(ordered), size)]


@torch.no_grad()
def _score_all(
    model: PreTrainedModel, samples: list[Sample], s: UpdateSettings, pad: int, which: set[int]
) -> list[torch.Tensor]:
    """Per-sample log-probs of the completion tokens under `model` (old policy or reference);
    samples outside `which` are not scored (zeros: they are never trained on)."""
    out: list[torch.Tensor] = [torch.zeros(len(smp.completion.token_ids)) for smp in samples]
    device = next(model.parameters()).device
    for micro in _micro_batches(sorted(which), samples, s.micro_batch_size):
        batch = collate([samples[i] for i in micro], pad, device)
        lp_BT, _ = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"],
                                  temperature=s.temperature, chunk_size=s.logprob_chunk)
        for row, i in enumerate(micro):
            out[i] = lp_BT[row][batch["loss_mask"][row]]
    return out


def _rows(per_sample: list[torch.Tensor], micro: list[int], mask_BT: torch.Tensor) -> torch.Tensor:
    """Scatter per-sample completion values into the micro-batch's [B, T] layout."""
    out = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    return out.masked_scatter(mask_BT, torch.cat([per_sample[i] for i in micro]))


def shaped_rewards(groups: list[Group], s: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards_PG after the configured shaping functions, and their metrics."""
    rewards_PG = torch.tensor([g.rewards for g in groups], dtype=torch.float32)
    metrics: dict[str, float] = {}
    if not s.shaping:
        return rewards_PG, metrics
    lengths_PG = torch.tensor([[len(x.completion.token_ids) for x in g.samples] for g in groups])
    # correct: the first (correctness) reward function gave full marks, as in the accuracy metric
    correct_PG = torch.tensor([[is_correct(x, next(iter(x.reward_parts), "")) for x in g.samples] for g in groups])
    for name, kwargs in s.shaping:
        rewards_PG, m = SHAPING[name](rewards_PG, lengths_PG, correct_PG, s.max_tokens, **kwargs)
        metrics |= m
    metrics["shaping/reward_mean"] = float(rewards_PG.mean())
    return rewards_PG, metrics


def needs_greedy_baseline(advantage: str) -> bool:
    """Whether the estimator takes the reward of each prompt's greedy completion (ReMax)."""
    return "baseline_P" in inspect.signature(ESTIMATORS[advantage]).parameters


def compute_advantages(groups: list[Group], s: UpdateSettings) -> torch.Tensor:
    """advantages_PG from the groups' (shaped) rewards with the configured estimator."""
    return _advantages_and_shaping(groups, s)[0]


def _advantages_and_shaping(groups: list[Group], s: UpdateSettings) -> tuple[torch.Tensor, dict[str, float]]:
    rewards_PG, shaping_metrics = shaped_rewards(groups, s)
    kwargs = dict(s.advantage_kwargs)
    if needs_greedy_baseline(s.advantage):
        missing = [g.prompt[:40] for g in groups if "greedy_reward" not in g.metadata]
        if missing:
            raise ValueError(f"advantage {s.advantage!r} needs each group's metadata['greedy_reward'] (the "
                             f"reward of a greedy completion; `rlvr train` adds it); missing for {missing[0]!r}")
        kwargs["baseline_P"] = torch.tensor([float(g.metadata["greedy_reward"]) for g in groups])
    return ESTIMATORS[s.advantage](rewards_PG, **kwargs), shaping_metrics


def update_policy(
    learner: Learner,
    groups: list[Group],
    s: UpdateSettings,
    *,
    pad_token_id: int,
    ref_model: PreTrainedModel | None = None,
    generator: torch.Generator | None = None,
) -> dict[str, float]:
    """Advantages from the groups' rewards, then the policy-gradient update; returns metrics."""
    advantages_PG, shaping_metrics = _advantages_and_shaping(groups, s)
    samples = [smp for g in groups for smp in g.samples]
    advantages_B = advantages_PG.flatten()
    model, device = learner.model, next(learner.model.parameters()).device
    # With one optimizer step per rollout batch the policy has not moved yet, so the old
    # log-probs equal the current ones (detached) and the extra forward pass is skipped.
    reuse_current = s.epochs * s.mini_batches == 1
    # A sample with zero advantage adds exactly zero to the policy loss and its gradient, so it is
    # not run at all unless a KL or entropy term gives it a gradient of its own. (GRPO groups whose
    # rewards are all equal are common: 30-90% of groups late in a run.)
    needs_all = s.kl_coef > 0 or s.entropy_coef != 0
    # DAPO's overlong filtering: a completion cut off by the token budget is left out of the
    # loss altogether (numerator and the token/sequence counts), not treated as a failure.
    dropped = {i for i, smp in enumerate(samples) if s.mask_truncated and smp.completion.finish_reason == "length"}
    trained = {i for i in range(len(samples)) if (needs_all or advantages_B[i] != 0) and i not in dropped}
    old = None if reuse_current else _score_all(model, samples, s, pad_token_id, trained)
    ref = _score_all(ref_model, samples, s, pad_token_id, trained) if (s.kl_coef > 0 and ref_model is not None) else None

    sums: dict[str, float] = defaultdict(float)
    grad_norms = []
    model.train()
    for _ in range(s.epochs):
        order = torch.randperm(len(samples), generator=generator).tolist()
        size = len(samples) // s.mini_batches
        for k in range(s.mini_batches):
            mini = [i for i in order[k * size : (k + 1) * size] if i not in dropped]
            totals = {"total_tokens": float(sum(len(samples[i].completion.token_ids) for i in mini)),
                      "total_seqs": float(len(mini))}
            # The totals count every sample of the mini-batch, skipped for zero advantage or
            # not: the gradient is the one of the full mini-batch.
            run = [i for i in mini if i in trained]
            for micro in _micro_batches(run, samples, s.micro_batch_size):
                _accumulate(learner, samples, micro, advantages_B, old, ref, s, totals, pad_token_id, device, sums)
            grad_norms.append(learner.step())
    tokens, loss_sum = sums.pop("_tokens", 0.0), sums.pop("loss", 0.0)
    maxima = {k.removeprefix("_max/"): sums.pop(k) for k in [k for k in sums if k.startswith("_max/")]}
    # token-weighted means over the trained tokens; NaN (null in metrics.jsonl) when none was trained
    names = set(sums) | {k for k in _TOKEN_METRICS if k != "kl" or ref is not None}
    metrics = {k: sums[k] / tokens if tokens else float("nan") for k in sorted(names)}
    metrics["loss"] = loss_sum / len(grad_norms)  # mean over optimizer steps
    metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
    metrics["advantage_abs_mean"] = float(advantages_B.abs().mean())
    metrics["trained_fraction"] = len(trained) / len(samples)
    if s.mask_truncated:
        metrics["masked_truncated_fraction"] = len(dropped) / len(samples)
    return metrics | {k: v for k, v in maxima.items() if k != "ratio_max"} | shaping_metrics


def _accumulate(
    learner: Learner,
    samples: list[Sample],
    micro: list[int],
    advantages_B: torch.Tensor,
    old: list[torch.Tensor] | None,
    ref: list[torch.Tensor] | None,
    s: UpdateSettings,
    totals: dict[str, float],
    pad_token_id: int,
    device: torch.device,
    sums: dict[str, float],
) -> None:
    """Forward and backward one micro-batch; add its token-weighted metrics to `sums`."""
    batch = collate([samples[i] for i in micro], pad_token_id, device)
    mask_BT = batch["loss_mask"]
    logprobs_BT, entropy_BT = token_logprobs(learner.model, batch["input_ids"], batch["attention_mask"], mask_BT,
                                             temperature=s.temperature, chunk_size=s.logprob_chunk)
    old_BT = logprobs_BT.detach() if old is None else _rows(old, micro, mask_BT)
    adv_BT = advantages_B[micro].to(device)[:, None].expand_as(logprobs_BT)
    loss_BT, loss_metrics = LOSSES[s.loss](logprobs_BT, old_BT, adv_BT, mask_BT, **s.loss_kwargs)
    # The engine's own log-probs of what it sampled, against the learner's before this update.
    sampler_BT = _rows([torch.tensor(samples[i].completion.logprobs, dtype=torch.float32) for i in micro],
                       list(range(len(micro))), mask_BT)
    weights_BT, is_metrics = CORRECTIONS[s.offpolicy](old_BT, sampler_BT, mask_BT, **s.offpolicy_kwargs)
    loss_BT = loss_BT * weights_BT
    loss_metrics = {**loss_metrics, **is_metrics, **mismatch_metrics(old_BT, sampler_BT, mask_BT)}
    if ref is not None:
        kl_BT = KL_ESTIMATORS[s.kl_estimator](logprobs_BT, _rows(ref, micro, mask_BT))
        loss_BT = loss_BT + s.kl_coef * kl_BT
        sums["kl"] += float(kl_BT.detach()[mask_BT].sum())
    if s.entropy_coef:
        loss_BT = loss_BT - s.entropy_coef * entropy_BT
    loss = aggregate_loss(loss_BT, mask_BT, mode=s.aggregation, max_tokens=s.max_tokens, **totals)
    loss.backward()
    n = float(mask_BT.sum())
    sums["_tokens"] += n
    sums["loss"] += float(loss.detach())  # micro-batch aggregates sum to the mini-batch loss
    sums["entropy"] += float(entropy_BT.detach()[mask_BT].sum())
    for key, value in loss_metrics.items():
        if key.endswith("_max"):  # maxima over the update, kept apart from the token-weighted sums
            sums["_max/" + key] = max(sums.get("_max/" + key, float("-inf")), float(value))
        else:
            sums[key] += float(value) * n
