"""Policy losses beyond ppo_clip (tests/test_algos.py) against hand-computed values and gradients."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import LOSSES
from rlvr.config import load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

F64 = torch.float64


def run(name: str, logprobs: list[list[float]], old: list[list[float]], adv: list[list[float]],
        mask: list[list[int]], **kwargs: float) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_BT, d(sum of loss)/d logprobs, metrics)."""
    lp = torch.tensor(logprobs, dtype=F64, requires_grad=True)
    loss_BT, metrics = LOSSES[name](lp, torch.tensor(old, dtype=F64), torch.tensor(adv, dtype=F64),
                                    torch.tensor(mask, dtype=torch.bool), **kwargs)
    loss_BT.sum().backward()
    assert lp.grad is not None
    return loss_BT.detach(), lp.grad, metrics


def close(actual: torch.Tensor, expected: object) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=F64), atol=1e-9, rtol=0)


def test_pg_is_minus_advantage_times_logprob() -> None:
    loss, grad, metrics = run("pg", [[-1.0, -2.0]], [[-1.0, -9.0]], [[2.0, 2.0]], [[1, 0]])
    close(loss, [[2.0, 0.0]])
    close(grad, [[-2.0, 0.0]])
    close(metrics["ratio_mean"], 1.0)


def test_cispo_caps_the_weight_but_keeps_the_gradient() -> None:
    # token 1: ratio 3 -> weight capped at 2, A = 1, log π = -0.5: loss = -2·1·(-0.5) = 1, grad -2
    # token 2: ratio 0.5 -> weight 0.5 (no lower bound by default), A = -1, log π = -1: loss -0.5, grad 0.5
    lp = [[-0.5, -1.0]]
    old = [[-0.5 - math.log(3.0), -1.0 - math.log(0.5)]]
    loss, grad, metrics = run("cispo", lp, old, [[1.0, -1.0]], [[1, 1]])
    close(loss, [[1.0, -0.5]])
    close(grad, [[-2.0, 0.5]])  # PPO would give token 1 a zero gradient here
    close(metrics["weight_clip_fraction"], 0.5)
    _, grad, metrics = run("cispo", lp, old, [[1.0, -1.0]], [[1, 1]], min_weight=0.8, max_weight=4.0)
    close(grad, [[-3.0, 0.8]])
    close(metrics["weight_clip_fraction"], 0.5)
    with pytest.raises(ValueError, match="max_weight"):
        run("cispo", lp, old, [[1.0, -1.0]], [[1, 1]], max_weight=0.9)


def test_gspo_uses_the_geometric_mean_ratio_of_each_sequence() -> None:
    # row 1: log ratios 0.2 and 0.0 -> s = e^0.1, A = 1, inside [0.8, 1.2]: loss -s on both tokens,
    #        d loss_b / d log π_t = -A·s/|y| = -s/2 per token, and the loss repeats on 2 tokens: -s each
    # row 2: one token, log ratio -0.5 -> s = e^-0.5 = 0.6065, A = -2: min(-1.213, 0.8·-2 = -1.6)
    #        -> loss 1.6, clipped, no gradient; the padded column gets nothing
    s1 = math.exp(0.1)
    lp = [[-1.0, -2.0], [-3.0, 0.0]]
    old = [[-1.2, -2.0], [-2.5, 0.0]]
    adv = [[1.0, 1.0], [-2.0, -2.0]]
    loss, grad, metrics = run("gspo", lp, old, adv, [[1, 1], [1, 0]], clip_low=0.2, clip_high=0.2)
    close(loss, [[-s1, -s1], [1.6, 0.0]])
    close(grad, [[-s1, -s1], [0.0, 0.0]])
    close(metrics["clip_fraction"], 0.5)
    close(metrics["ratio_mean"], (s1 + math.exp(-0.5)) / 2)
    # a tighter upper clip catches row 1 too
    loss, grad, metrics = run("gspo", lp, old, adv, [[1, 1], [1, 0]], clip_low=0.2, clip_high=0.05)
    close(loss[0], [-1.05, -1.05])
    close(grad, [[0.0, 0.0], [0.0, 0.0]])
    close(metrics["clip_fraction"], 1.0)


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "topr", "opmd"])
def test_masked_positions_do_not_matter(name: str) -> None:
    base = dict(logprobs=[[-1.0, -2.0, -0.5]], old=[[-1.1, -2.0, -0.4]], adv=[[1.5, 1.5, 1.5]], mask=[[1, 1, 0]])
    loss, grad, _ = run(name, **base)  # type: ignore[arg-type]
    junk = dict(base, logprobs=[[-1.0, -2.0, float("nan")]], old=[[-1.1, -2.0, float("inf")]])
    loss2, grad2, _ = run(name, **junk)  # type: ignore[arg-type]
    close(loss2, loss)
    close(grad2, grad)
    assert loss[0, 2] == 0 and grad[0, 2] == 0


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "ppo_clip", "topr", "opmd"])
def test_on_policy_gradient_is_the_policy_gradient(name: str) -> None:
    """At ratio 1 the summed loss has gradient -A on every token for all of them; they differ
    only off-policy. (gspo: -A·s/|y| per token from each of the |y| repeated sequence losses.)"""
    lp = [[-1.0, -2.0]]
    _, grad, _ = run(name, lp, lp, [[0.7, 0.7]], [[1, 1]])
    close(grad, [[-0.7, -0.7]])


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "topr", "opmd"])
def test_two_training_steps_with_every_loss(name: str, tiny_dir: Path, tmp_path: Path) -> None:
    aggregation = '"seq-mean-token-mean"' if name == "gspo" else '"token-mean"'
    train(load_config(None, overrides(tiny_dir, tmp_path, f"loss-{name}", algo__loss=f'"{name}"',
                                      algo__aggregation=aggregation)), quiet=True)
    rows = read_metrics(tmp_path / f"loss-{name}")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    if name == "cispo":
        assert "weight_clip_fraction" in rows[0]


def test_topr_tapers_only_negatives() -> None:
    # token 1: A = 2 > 0, ratio 3 -> α = 1: loss -2·(-0.5) = 1, grad -2 (no IS on positives)
    # token 2: A = -1, ratio 3 -> α = 1 (clamped): loss -(1)(-1)(-1) = -1, grad +1
    # token 3: A = -1, ratio 0.5 -> α = 0.5: loss -0.5·(-1)·(-2) = -1, grad +0.5
    lp = [[-0.5, -1.0, -2.0]]
    old = [[-0.5 - math.log(3.0), -1.0 - math.log(3.0), -2.0 - math.log(0.5)]]
    loss, grad, metrics = run("topr", lp, old, [[2.0, -1.0, -1.0]], [[1, 1, 1]])
    close(loss, [[1.0, -1.0, -1.0]])
    close(grad, [[-2.0, 1.0, 0.5]])
    close(metrics["topr_clamped_fraction"], 0.5)
    # sequence level: the row's ratio is 3·3·0.5 = 4.5 -> α = 1 on both negatives
    _, grad, _ = run("topr", lp, old, [[2.0, -1.0, -1.0]], [[1, 1, 1]], level="sequence")
    close(grad, [[-2.0, 1.0, 1.0]])


def test_opmd_adds_a_squared_log_ratio_penalty() -> None:
    # A = 1, log π = -1, log π_old = -1.5: loss = 1 + τ/2·0.25; grad = -1 + τ·0.5
    loss, grad, metrics = run("opmd", [[-1.0]], [[-1.5]], [[1.0]], [[1]], tau=2.0)
    close(loss, [[1.0 + 0.25]])
    close(grad, [[-1.0 + 1.0]])
    close(metrics["opmd_penalty"], 0.125)
