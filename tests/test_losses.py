"""Policy losses beyond ppo_clip (tests/test_algos.py) against hand-computed values and gradients."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from rlvr.algos import LOSSES
from rlvr.algos.inputs import LossInputs, StatefulLoss
from rlvr.config import load_config
from rlvr.train.loop import train
from tests.test_train import overrides, read_metrics

F64 = torch.float64


_FIELDS = {f.name for f in dataclasses.fields(LossInputs)}


def loop_fields(shape: torch.Size) -> dict[str, object]:
    """The LossInputs fields the training loop would fill in besides the first four: a fresh
    state; every sample correct in a group that is half right (NFT)."""
    return {"state": {}, "correct": torch.ones(shape, dtype=torch.bool),
            "group_accuracy": torch.full(shape, 0.5, dtype=F64)}


def run(name: str, logprobs: list[list[float]], old: list[list[float]], adv: list[list[float]],
        mask: list[list[int]], **kwargs: object) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(loss_BT, d(sum of loss)/d logprobs, metrics). A keyword naming a LossInputs field
    (``state``, ``correct``, ...) replaces the loop's value in the record; the rest are the loss's knobs."""
    lp = torch.tensor(logprobs, dtype=F64, requires_grad=True)
    fields = loop_fields(lp.shape) | {k: v for k, v in kwargs.items() if k in _FIELDS}
    knobs = {k: v for k, v in kwargs.items() if k not in _FIELDS}
    x = LossInputs(lp, torch.tensor(old, dtype=F64), torch.tensor(adv, dtype=F64),
                   torch.tensor(mask, dtype=torch.bool), **fields)  # type: ignore[arg-type]
    loss_BT, metrics = LOSSES[name](x, **knobs)
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


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "topr", "opmd", "bapo", "rec", "r2vpo", "nft"])
def test_masked_positions_do_not_matter(name: str) -> None:
    base = dict(logprobs=[[-1.0, -2.0, -0.5]], old=[[-1.1, -2.0, -0.4]], adv=[[1.5, 1.5, 1.5]], mask=[[1, 1, 0]])
    loss, grad, _ = run(name, **base)  # type: ignore[arg-type]
    junk = dict(base, logprobs=[[-1.0, -2.0, float("nan")]], old=[[-1.1, -2.0, float("inf")]])
    loss2, grad2, _ = run(name, **junk)  # type: ignore[arg-type]
    close(loss2, loss)
    close(grad2, grad)
    assert loss[0, 2] == 0 and grad[0, 2] == 0


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "ppo_clip", "topr", "opmd", "bapo", "rec", "r2vpo"])
def test_on_policy_gradient_is_the_policy_gradient(name: str) -> None:
    """At ratio 1 the summed loss has gradient -A on every token for all of them; they differ
    only off-policy. (gspo: -A·s/|y| per token from each of the |y| repeated sequence losses.)"""
    lp = [[-1.0, -2.0]]
    _, grad, _ = run(name, lp, lp, [[0.7, 0.7]], [[1, 1]])
    close(grad, [[-0.7, -0.7]])


def four_distinct(prompt: str, completion: str, **_: object) -> float:
    """A pass/fail reward the tiny random model sometimes passes (NFT needs correct samples)."""
    return float(len(set(completion)) >= 4)


# metrics each loss must put in metrics.jsonl
_EXPOSES = {
    "cispo": {"weight_clip_fraction"},
    "topr": {"topr_clamped_fraction"},
    "bapo": {"bapo_clip_low", "bapo_clip_high", "bapo_positive_share", "clip_fraction_low", "clip_fraction_high"},
    "rec": {"rec_dropped_fraction"},
    "r2vpo": {"r2vpo_lambda", "r2vpo_variance"},
    "nft": {"nft_negative_clamped_fraction"},
}


@pytest.mark.parametrize("name", ["pg", "cispo", "gspo", "topr", "opmd", "bapo", "rec", "r2vpo", "nft"])
def test_two_training_steps_with_every_loss(name: str, tiny_dir: Path, tmp_path: Path) -> None:
    """Two mini-batches per step, so the second is off-policy and the ratios move."""
    aggregation = '"seq-mean-token-mean"' if name == "gspo" else '"token-mean"'
    train(load_config(None, overrides(tiny_dir, tmp_path, f"loss-{name}", algo__loss=f'"{name}"',
                                      algo__aggregation=aggregation, train__mini_batches=2,
                                      **({"rewards": '[{fn = "tests.test_losses:four_distinct"}]'} if name == "nft" else {}))),
          quiet=True)
    rows = read_metrics(tmp_path / f"loss-{name}")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    assert _EXPOSES.get(name, set()) <= rows[0].keys()
    if name == "r2vpo":  # λ took a dual-ascent step after every optimizer step
        assert rows[0]["r2vpo_lambda"] != rows[1]["r2vpo_lambda"]


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


def bapo_tokens(ratios: list[float], adv: list[float]) -> dict[str, list[list[float]]]:
    lp = [-1.0] * len(ratios)
    return {"logprobs": [lp], "old": [[-1.0 - math.log(r) for r in ratios]], "adv": [adv], "mask": [[1] * len(ratios)]}


def test_bapo_raises_the_lower_bound_first_until_positives_reach_the_share() -> None:
    # at (0.6, 1.2): positives with gradient {ratio 1.0}: 1·1.0; negatives {0.7, 1.0}: 1.7 -> share 0.37.
    # c_low 0.75 drops the 0.7 negative: share 1/(1 + 1) = 0.5, the target -> stop there.
    t = bapo_tokens([1.0, 1.5, 0.7, 1.0], [1.0, 1.0, -1.0, -1.0])
    loss, grad, m = run("bapo", **t)  # type: ignore[arg-type]
    assert float(m["bapo_clip_low"]) == pytest.approx(0.75) and float(m["bapo_clip_high"]) == pytest.approx(1.2)
    close(m["bapo_positive_share"], 0.5)
    ref_loss, ref_grad, _ = run("ppo_clip", **t, clip_low=0.25, clip_high=0.2, dual_clip=3.0)  # type: ignore[arg-type]
    close(loss, ref_loss)
    close(grad, ref_grad)
    close(grad, [[-1.0, 0.0, 0.0, 1.0]])  # ratio 1.5 > 1.2 and 0.7 < 0.75 are clipped


def test_bapo_then_raises_the_upper_bound_and_stops_at_the_last_bounds() -> None:
    # the negative at ratio 1 survives any c_low <= 0.9, so c_high rises until 1.42 is admitted (1.45)
    _, _, m = run("bapo", **bapo_tokens([1.42, 1.0], [1.0, -1.0]))  # type: ignore[arg-type]
    assert float(m["bapo_clip_low"]) == pytest.approx(0.9) and float(m["bapo_clip_high"]) == pytest.approx(1.45)
    close(m["bapo_positive_share"], 1.42 / 2.42)
    # unreachable: a positive beyond 3 never counts -> the last bounds
    _, _, m = run("bapo", **bapo_tokens([3.5, 1.0], [1.0, -1.0]))  # type: ignore[arg-type]
    assert float(m["bapo_clip_low"]) == pytest.approx(0.9) and float(m["bapo_clip_high"]) == pytest.approx(3.0)
    close(m["bapo_positive_share"], 0.0)


REC_RATIOS = [1.1, 1.3, 0.9, 0.7, 0.3, 3.5, 0.6]
REC_ADV = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
REC_KEEP = {  # eps 0.2 / 0.2, ring eps' 0.6 / 2.0 (keep ratio <= 0.4 for A >= 0, >= 3 for A <= 0)
    "none": [1, 1, 1, 1, 1, 1, 1],
    "two-side": [1, 0, 1, 0, 0, 0, 0],
    "one-side": [1, 0, 1, 0, 1, 1, 1],
    "ring": [1, 0, 1, 0, 1, 1, 0],
}


@pytest.mark.parametrize("clip", sorted(REC_KEEP))
def test_rec_clip_modes_keep_the_tokens_their_rule_names(clip: str) -> None:
    t = bapo_tokens(REC_RATIOS, REC_ADV)
    keep = REC_KEEP[clip]
    loss, grad, m = run("rec", **t, clip=clip)  # type: ignore[arg-type]
    close(grad, [[-a * k for a, k in zip(REC_ADV, keep)]])
    close(loss, [[a * k for a, k in zip(REC_ADV, keep)]])  # -A·(-1)
    assert float(m["rec_dropped_fraction"]) == pytest.approx(1 - sum(keep) / len(keep))
    _, grad, _ = run("rec", **t, clip=clip, weight="ratio")  # type: ignore[arg-type]
    close(grad, [[-a * r * k for a, r, k in zip(REC_ADV, REC_RATIOS, keep)]])
    _, grad, _ = run("rec", **t, clip=clip, weight="advantage", temperature=2.0)  # type: ignore[arg-type]
    close(grad, [[-a * math.exp(a / 2) * k for a, k in zip(REC_ADV, keep)]])


def test_rec_regularisers() -> None:
    # one token, A = 1, log π = -1, log π_old = -1.5 (ratio e^0.5, inside no clip with clip none)
    _, grad, _ = run("rec", [[-1.0]], [[-1.5]], [[1.0]], [[1]], clip="none", regularizer="asymre", reg_coef=0.1)
    close(grad, [[-1.0 - 0.1]])  # -A - λ: a lowered baseline
    loss, grad, _ = run("rec", [[-1.0]], [[-1.5]], [[1.0]], [[1]], clip="none", regularizer="opmd", reg_coef=0.1)
    close(loss, [[1.0 + 0.1 * 0.25]])
    close(grad, [[-1.0 + 2 * 0.1 * 0.5]])
    with pytest.raises(ValueError, match="clip must be one of"):
        run("rec", [[-1.0]], [[-1.0]], [[1.0]], [[1]], clip="both")


def test_r2vpo_by_hand() -> None:
    # ratio 1.2, A = 1, λ = 2: loss -1.2 + 2·0.04 = -1.12; d/dlog π = -A·ρ + 2λ(ρ-1)ρ = -1.2 + 0.96
    state = {"lam": 2.0}
    loss, grad, m = run("r2vpo", [[0.0]], [[-math.log(1.2)]], [[1.0]], [[1]], state=state)
    close(loss, [[-1.12]])
    close(grad, [[-0.24]])
    close(m["r2vpo_variance"], 0.04)
    assert float(m["r2vpo_lambda"]) == 2.0
    r2vpo = LOSSES["r2vpo"]
    assert isinstance(r2vpo, StatefulLoss)  # the update calls its after_step after each optimizer step
    assert not [n for n, fn in LOSSES.items() if n != "r2vpo" and isinstance(fn, StatefulLoss)]
    r2vpo.after_step(state, {"r2vpo_variance": 0.04})  # λ + η(V - δ) = 2 + (0.04 - 0.01)
    assert state["lam"] == pytest.approx(2.03)
    state = {"lam": 0.005}
    r2vpo.after_step(state, {"r2vpo_variance": 0.0})
    assert state["lam"] == 0.0  # projected onto λ >= 0
    fresh: dict[str, float] = {}
    run("r2vpo", [[0.0]], [[0.0]], [[1.0]], [[1]], state=fresh, lam_init=0.5)
    assert fresh == {"lam": 0.5}


def nft(ratios: list[float], correct: list[int], accuracy: float, **kw: object) -> tuple[torch.Tensor, torch.Tensor, dict]:
    t = bapo_tokens(ratios, [0.0] * len(ratios))
    shape = torch.Size([1, len(ratios)])
    return run("nft", **t, correct=torch.tensor([correct], dtype=torch.bool),  # type: ignore[arg-type]
               group_accuracy=torch.full(shape, accuracy, dtype=F64), **kw)


def test_nft_by_hand() -> None:
    # r = 0.5, weight 1 - r = 0.5.
    # correct, ratio 2:  loss -0.5·log 2, grad -0.5
    # wrong, ratio 0.5:  x = (1 - 0.25)/0.5 = 1.5, loss -0.5·log 1.5, grad 0.5·rρ/((1-r)x) = 0.5·(1/3)
    # wrong, ratio 1.5:  x = 0.5 < 1 -> value clamped to 1 (loss 0), gradient passed through: 0.5·0.75/0.5
    loss, grad, m = nft([2.0, 0.5, 1.5], [1, 0, 0], 0.5)
    close(loss, [[-0.5 * math.log(2.0), -0.5 * math.log(1.5), 0.0]])
    close(grad, [[-0.5, 0.5 / 3, 0.75]])
    assert float(m["nft_negative_clamped_fraction"]) == 0.5
    loss, grad, _ = nft([2.0, 0.5], [1, 1], 1.0)  # a group that is all correct: no loss
    close(loss, [[0.0, 0.0]])
    close(grad, [[0.0, 0.0]])


def test_nft_on_policy_is_dr_grpo_with_accuracy_baseline() -> None:
    r = 0.25
    _, grad, _ = nft([1.0, 1.0], [1, 0], r)
    close(grad, [[-(1 - r), r]])  # -A with A = correct - r
    _, grad, _ = nft([1.0, 1.0], [1, 0], r, prompt_weight="grpo")
    w = math.sqrt((1 - r) / r)
    close(grad, [[-w, w * r / (1 - r)]])
