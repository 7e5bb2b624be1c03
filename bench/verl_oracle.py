"""rlvr's loss aggregation, its SAPO, GMPO, Clip-Cov and KL-Cov losses and its geometric-mean
sequence mask against verl's (`agg_loss`, `compute_policy_loss_sapo`, `compute_policy_loss_geo_mean`,
`compute_policy_loss_clip_cov`, `compute_policy_loss_kl_cov`, `compute_rollout_rejection_mask` with
"seq_mean_k1"), as a numeric oracle (not a test: verl is
not a dependency). Run with a Python that has verl 0.9.1 (installed --no-deps, plus the few
modules its core_algos imports; docs/algorithms.md says how) and rlvr on the path:

    PYTHONPATH=. /tmp/verlenv/bin/python bench/verl_oracle.py

Prints, per mode, the largest absolute difference over random batches with empty rows, in
float64 (so a difference is a convention, not rounding) and float32.
"""

from __future__ import annotations

import torch
import verl.trainer.ppo.core_algos as core_algos

from rlvr.algos.aggregation import AGGREGATIONS, aggregate_loss
from rlvr.algos import entropy_control
from rlvr.algos.entropy_control import clip_cov_loss, kl_cov_loss, token_covariance
from rlvr.algos.inputs import LossInputs
from rlvr.algos.offpolicy import geometric_mask
from rlvr.algos.smooth_losses import gmpo_loss, sapo_loss


def batches(generator: torch.Generator, dtype: torch.dtype, count: int = 200):  # type: ignore[no-untyped-def]
    """Random (logprobs, old logprobs, advantages, mask): rows of 1-32 tokens, some empty, one
    advantage per row (outcome advantages), log-ratios up to about ±1."""
    for trial in range(count):
        b, t = int(torch.randint(1, 9, (1,), generator=generator)), int(torch.randint(1, 33, (1,), generator=generator))
        lengths = torch.randint(0, t + 1, (b,), generator=generator)
        if trial % 4 == 0:
            lengths[0] = 0
        if int(lengths.sum()) == 0:
            continue
        mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
        old = -torch.rand(b, t, generator=generator, dtype=dtype) * 3
        new = old + torch.randn(b, t, generator=generator, dtype=dtype) * 0.5
        adv = torch.randn(b, 1, generator=generator, dtype=dtype).expand(b, t).clone()
        yield new, old, adv, mask


def losses(generator: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    """Largest |verl − rlvr| of the aggregated loss and of its gradient, per loss."""
    from verl.workers.config import ActorConfig

    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1,
                         clip_ratio_low=0.4, clip_ratio_high=0.4)
    registry = core_algos.POLICY_LOSS_REGISTRY
    worst = {"sapo": 0.0, "sapo grad": 0.0, "gmpo": 0.0, "gmpo grad": 0.0}
    for new, old, adv, mask in batches(generator, dtype):
        rows, non_empty = new.shape[0], int((mask.sum(-1) > 0).sum())
        for name, theirs_fn, ours_fn, seqs in (
                ("sapo", registry["sapo"], lambda *a: sapo_loss(LossInputs(*a), tau_pos=1.0, tau_neg=1.05), non_empty),
                ("gmpo", registry["geo_mean"], lambda *a: gmpo_loss(LossInputs(*a), clip_low=0.4, clip_high=0.4), rows)):
            a = new.clone().requires_grad_()
            theirs, _ = theirs_fn(old, a, adv, mask, "seq-mean-token-mean", config)
            (grad_theirs,) = torch.autograd.grad(theirs, a)
            b = new.clone().requires_grad_()
            loss_BT, _ = ours_fn(b, old, adv, mask)
            ours = aggregate_loss(loss_BT, mask, mode="seq-mean-token-mean", total_seqs=seqs)
            (grad_ours,) = torch.autograd.grad(ours, b)
            worst[name] = max(worst[name], float((theirs - ours).detach().abs()))
            worst[f"{name} grad"] = max(worst[f"{name} grad"], float((grad_theirs - grad_ours).abs().max()))
    return worst


def covariance_losses(generator: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    """Largest |verl − rlvr| of Clip-Cov's and KL-Cov's token-mean loss and gradient. Clip-Cov's
    random draw: both start from the same global seed and draw with one torch.randperm over the
    candidates in row-major order. KL-Cov's top-k is compared where it is unique: a batch whose
    k-th and (k+1)-th largest covariances tie (e.g. one row: its outcome advantage is constant, so
    every covariance is 0, up to rounding) may choose either, in verl and here; those are counted,
    not compared.
    Also counts the batches where Clip-Cov chose a token at all. rlvr rounds Clip-Cov's count
    r·N up or down at random (`chosen_count`), where verl takes max(1, ⌊r·N⌋); the comparison runs
    rlvr's loss with verl's count, so that what is compared is the rest of the formula."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    entropy_control.chosen_count = lambda expected: max(1, int(expected))  # verl's count, this process only

    policy_loss = PolicyLossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.5, clip_cov_ub=3.0, kl_cov_ratio=0.05,
                                   ppo_kl_coef=1.0)
    config = ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, ppo_mini_batch_size=1, rollout_n=1,
                         clip_ratio_low=0.2, clip_ratio_high=0.28, policy_loss=policy_loss)
    ours_fns = {"clip_cov": lambda *a: clip_cov_loss(LossInputs(*a), clip_ratio=0.05, cov_low=0.5, cov_high=3.0,
                                                     clip_low=0.2, clip_high=0.28),
                "kl_cov": lambda *a: kl_cov_loss(LossInputs(*a), kl_ratio=0.05, kl_coef=1.0)}
    worst = {"clip_cov": 0.0, "clip_cov grad": 0.0, "kl_cov": 0.0, "kl_cov grad": 0.0, "batches with a choice": 0.0,
             "kl_cov ties skipped": 0.0}
    for trial, (new, old, adv, mask) in enumerate(batches(generator, dtype)):
        tokens = mask.sum()
        covariance = token_covariance(new, adv, mask)[mask.bool()].sort(descending=True).values
        k = max(1, int(0.05 * int(tokens)))
        # (a difference under 1e-6, on covariances of order 1, is rounding: zeros computed as ±1e-16)
        tied = len(covariance) > k and bool(covariance[k - 1] - covariance[k] < 1e-6)
        worst["kl_cov ties skipped"] += float(tied)
        for name in ("clip_cov", "kl_cov")[: 1 if tied else 2]:
            a = new.clone().requires_grad_()
            torch.manual_seed(trial)
            theirs, _ = core_algos.POLICY_LOSS_REGISTRY[name](old, a, adv, mask, "token-mean", config)
            (grad_theirs,) = torch.autograd.grad(theirs, a)
            b = new.clone().requires_grad_()
            torch.manual_seed(trial)
            loss_BT, metrics = ours_fns[name](b, old, adv, mask)
            ours = loss_BT.sum() / tokens
            (grad_ours,) = torch.autograd.grad(ours, b)
            worst[name] = max(worst[name], float((theirs - ours).detach().abs()))
            worst[f"{name} grad"] = max(worst[f"{name} grad"], float((grad_theirs - grad_ours).abs().max()))
            if name == "clip_cov":
                worst["batches with a choice"] += float(metrics["cov_clipped_fraction"] > 0)
    return worst


def geometric_masks(generator: torch.Generator, dtype: torch.dtype) -> dict[str, float]:
    """Rows kept differently by rlvr's geo_mask and verl's seq_mean_k1 rejection (verl bounds
    exp(mean log(μ / π_old)) in [a, b], so rlvr's bounds are [1/b, 1/a]); and the share of rows
    masked, so that the comparison is not vacuous."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_rejection_mask

    differ = masked = rows = 0
    for old, sampler, _, mask in batches(generator, dtype):
        old = sampler + (old - sampler) * 0.004  # log-ratios of about ±0.002, around the bounds
        verl_mask, _ = compute_rollout_rejection_mask(old - sampler, mask, "seq_mean_k1", "0.999_1.001")
        inputs = LossInputs(old, old, torch.zeros_like(old), mask, sampler=sampler)
        weights, _ = geometric_mask(inputs, low=1 / 1.001, high=1 / 0.999)
        has = mask.sum(-1) > 0
        differ += int(((verl_mask.sum(-1) > 0) != (weights.sum(-1) > 0))[has].sum())
        masked += int((weights.sum(-1) == 0)[has].sum())
        rows += int(has.sum())
    return {"rows kept differently": float(differ), "rows masked (share)": masked / rows}


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        worst = dict.fromkeys(AGGREGATIONS, 0.0)
        for trial in range(200):
            b, t = int(torch.randint(1, 9, (1,), generator=generator)), int(torch.randint(1, 33, (1,), generator=generator))
            loss = torch.randn(b, t, generator=generator, dtype=dtype)
            lengths = torch.randint(0, t + 1, (b,), generator=generator)
            if trial % 4 == 0:
                lengths[0] = 0  # an empty row
            if int(lengths.sum()) == 0:
                continue
            mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
            non_empty = int((lengths > 0).sum())
            for mode in AGGREGATIONS:
                # verl counts the non-empty sequences (global_batch_size) and normalises sum-norm
                # by loss_scale_factor; rlvr takes the same as total_seqs and max_tokens
                theirs = core_algos.agg_loss(loss, mask, mode, global_batch_size=non_empty, loss_scale_factor=t)
                ours = aggregate_loss(loss, mask, mode=mode, total_seqs=non_empty, max_tokens=t)
                worst[mode] = max(worst[mode], float((theirs - ours).abs()))
        print(dtype, {mode: f"{diff:.2e}" for mode, diff in worst.items()})
        print(dtype, {name: f"{diff:.2e}" for name, diff in losses(generator, dtype).items()})
        print(dtype, {name: f"{diff:.2e}" for name, diff in covariance_losses(generator, dtype).items()})
        print(dtype, geometric_masks(generator, dtype))


if __name__ == "__main__":
    main()
