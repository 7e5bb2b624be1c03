"""rlvr.train: token_logprobs against the naive full-logits computation, the Learner's optimizer
step, precision and schedule, and update_policy's gradient properties (micro-batching, zero
advantages, masking) against a plain reference loop. Tiny fp32 model unless stated."""

from __future__ import annotations

import dataclasses
import copy
import io
import math
from collections.abc import Callable

import pytest
import torch
from transformers import PreTrainedModel

from rlvr.algos import ESTIMATORS, LOSSES
from rlvr.algos.inputs import LossInputs
from rlvr.train.learner import Learner, lr_lambda
from rlvr.train.logprobs import token_logprobs
from rlvr.train.settings import AdvantageSettings, KLSettings, LossSettings, Passes, UpdateSettings
from rlvr.train.update import update_policy
from rlvr.types import Completion, Group, Sample
from tests.tiny import EOS_ID, make_tiny_model

# --- token_logprobs --------------------------------------------------------------------------


def right_padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three rows of lengths 9, 6, 4 (pad id 0); the target mask marks a "completion" in each."""
    gen = torch.Generator().manual_seed(0)
    lengths, prompt_lengths = [9, 6, 4], [3, 4, 1]
    ids = torch.zeros(3, 9, dtype=torch.long)
    attention = torch.zeros(3, 9, dtype=torch.long)
    target = torch.zeros(3, 9, dtype=torch.bool)
    for b, (n, p) in enumerate(zip(lengths, prompt_lengths)):
        ids[b, :n] = torch.randint(3, 259, (n,), generator=gen)
        attention[b, :n] = 1
        target[b, p:n] = True
    return ids, attention, target  # 6 + 2 + 3 = 11 target tokens


def naive_logprobs(model: PreTrainedModel, ids: torch.Tensor, attention: torch.Tensor, target: torch.Tensor,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Full [B, T, V] logits, log-softmax, gather: the computation token_logprobs avoids."""
    logp_BTV = (model(input_ids=ids, attention_mask=attention).logits.float() / temperature).log_softmax(-1)
    lp_BT = torch.zeros(ids.shape)
    ent_BT = torch.zeros(ids.shape)
    lp_BT[:, 1:] = logp_BTV[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    ent_BT[:, 1:] = -(logp_BTV[:, :-1].exp() * logp_BTV[:, :-1]).sum(-1)
    return lp_BT * target, ent_BT * target


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])  # 11 target tokens: 11 chunks, 3 uneven, 1
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.3])  # 0: the entropy gets no gradient
def test_token_logprobs_equal_naive(chunk_size: int, temperature: float, entropy_weight: float) -> None:
    model = make_tiny_model()
    ids, attention, target = right_padded_batch()
    lp, ent = token_logprobs(model, ids, attention, target, temperature=temperature, chunk_size=chunk_size)
    ref_lp, ref_ent = naive_logprobs(model, ids, attention, target, temperature)
    assert lp.dtype == torch.float32 and lp.shape == ids.shape
    assert (lp[~target] == 0).all() and (ent[~target] == 0).all()
    assert (lp[target] < 0).all() and (ent[target] > 0).all()
    torch.testing.assert_close(lp, ref_lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-5, rtol=0)

    # gradients of an arbitrary weighted sum of both outputs, wrt every parameter
    w_lp, w_ent = torch.randn(ids.shape, generator=torch.Generator().manual_seed(1)), entropy_weight
    ref_model = copy.deepcopy(model)
    (lp * w_lp).sum().add((ent * w_ent).sum()).backward()
    ref_lp, ref_ent = naive_logprobs(ref_model, ids, attention, target, temperature)
    (ref_lp * w_lp).sum().add((ref_ent * w_ent).sum()).backward()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_token_logprobs_rejects_target_at_column_zero() -> None:
    model = make_tiny_model()
    ids, attention, target = right_padded_batch()
    target[1, 0] = True
    with pytest.raises(ValueError, match="target_mask"):
        token_logprobs(model, ids, attention, target)


# --- learning-rate schedule ------------------------------------------------------------------


def test_lr_lambda_by_hand() -> None:
    # warmup 2 of 6 steps: (s + 1) / 3 for s = 0, 1; then progress = (s - 2) / 4
    def f(step: int, schedule: str) -> float:
        return lr_lambda(step, warmup_steps=2, total_steps=6, schedule=schedule)

    for schedule in ("constant", "linear", "cosine"):
        assert [f(s, schedule) for s in (0, 1)] == pytest.approx([1 / 3, 2 / 3])
        assert f(2, schedule) == pytest.approx(1.0)
    assert [f(s, "constant") for s in (3, 6, 50)] == [1.0, 1.0, 1.0]
    assert [f(s, "linear") for s in (3, 4, 5, 6, 9)] == pytest.approx([0.75, 0.5, 0.25, 0.0, 0.0])
    # cosine: 0.5 (1 + cos(pi * progress)); progress 1/4 → 0.85355, 1/2 → 0.5, 3/4 → 0.14645, ≥ 1 → 0
    assert [f(s, "cosine") for s in (3, 4, 5, 6, 9)] == pytest.approx(
        [0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.5 * (1 - math.cos(math.pi / 4)), 0.0, 0.0]
    )
    assert lr_lambda(0, warmup_steps=0, total_steps=4, schedule="linear") == 1.0
    with pytest.raises(ValueError, match="schedule"):
        f(3, "exponential")


def test_learner_follows_schedule() -> None:
    learner = Learner(make_tiny_model(), lr=0.1, warmup_steps=1, total_steps=3, schedule="linear")
    lrs = []
    for _ in range(4):
        lrs.append(learner.lr)
        learner.step()  # no gradients: nothing moves, but the schedule advances
    # step 0: warmup 1/2; steps 1, 2, 3: 1 - (s - 1) / 2 = 1, 0.5, 0
    assert lrs == pytest.approx([0.05, 0.1, 0.05, 0.0])


# --- Learner ---------------------------------------------------------------------------------


def lm_loss(model: PreTrainedModel) -> torch.Tensor:
    """A fixed differentiable loss: mean negative log-likelihood of a fixed batch's targets."""
    ids, attention, target = right_padded_batch()
    lp, _ = token_logprobs(model, ids, attention, target)
    return -lp.sum() / target.sum()


@pytest.mark.parametrize("grad_clip", [0.0, 0.05])
def test_fp32_step_equals_torch_adamw(grad_clip: float) -> None:
    """The learner's step is clipping plus torch's fused AdamW, exactly (same kernel, 1e-6)."""
    model = make_tiny_model()
    manual = copy.deepcopy(model)
    learner = Learner(model, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, grad_clip=grad_clip)
    assert learner.masters is learner.params  # fp32: the weights are their own masters
    optimizer = torch.optim.AdamW(manual.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, fused=True)
    for _ in range(2):
        lm_loss(model).backward()
        norm = learner.step()
        lm_loss(manual).backward()
        expected_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in manual.parameters() if p.grad is not None]))
        if grad_clip:
            assert expected_norm > grad_clip  # clipping is exercised
            torch.nn.utils.clip_grad_norm_(list(manual.parameters()), grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        assert norm == pytest.approx(float(expected_norm), rel=1e-5)
    assert all(p.grad is None for p in model.parameters())
    changed = False
    for (name, p), q, p0 in zip(model.named_parameters(), manual.parameters(), make_tiny_model().parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0, msg=name)
        changed |= not torch.equal(p, p0)
    assert changed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_step_marks_every_weight_changed(dtype: torch.dtype) -> None:
    """The engine's static decoder rebuilds its weight copies when a parameter's version counter
    moves; the fused AdamW kernel writes the weights without moving it, so the learner must."""
    model = make_tiny_model(dtype=dtype)
    learner = Learner(model, lr=1e-2)
    before = [p._version for p in model.parameters()]
    lm_loss(model).backward()
    learner.step()
    assert all(p._version > v for p, v in zip(model.parameters(), before))


def test_fused_adamw_is_torch_reference_adamw_to_rounding() -> None:
    """The learner uses torch's fused AdamW kernel (0.09 s a step on SmolLM2-135M against 0.4-1.5 s
    for the default per-tensor loop on a CPU). It computes the same formula in another order
    (bias corrections and lr folded into one step size), so the two agree to fp32 rounding of
    each step's terms; where a moment is a near-cancelling difference (a gradient changing sign)
    that relative error grows, so the bound is 1e-3 of one step's size (lr = 1e-2), far below
    what a wrong formula moves (a step)."""
    reference, fused = make_tiny_model(), make_tiny_model()
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, **kw)
                  for m, kw in ((reference, {"foreach": False}), (fused, {"fused": True}))]
    for _ in range(3):
        for m, opt in zip((reference, fused), optimizers):
            lm_loss(m).backward()
            opt.step()
            opt.zero_grad()
    for (name, p), q in zip(reference.named_parameters(), fused.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=0, msg=name)


def test_bf16_master_accumulates_updates_below_bf16_resolution() -> None:
    """RMSNorm weights start at exactly 1.0, where bf16's spacing is 2^-7 (below 1: 2^-8).

    One AdamW step at lr = 1.5e-3 moves a weight by ~1.5e-3 (Adam's first step is lr·sign(g)),
    which rounds back to 1.0 in bf16 (half-spacings 3.9e-3 above, 1.95e-3 below): the bf16
    weights stay put but the fp32 master moves. Five steps move the master ~7.5e-3, past the
    rounding threshold, so the bf16 weights change. Without the master, AdamW on the bf16
    weights themselves never moves them (the control below).
    """
    model = make_tiny_model(dtype=torch.bfloat16)
    control = copy.deepcopy(model)
    learner = Learner(model, lr=1.5e-3, weight_decay=0.0, grad_clip=0.0)
    assert learner.mixed and all(m.dtype == torch.float32 for m in learner.masters)
    norm_index = [i for i, (n, _) in enumerate(model.named_parameters()) if "norm" in n]
    assert norm_index and all(torch.equal(learner.params[i], torch.ones_like(learner.params[i])) for i in norm_index)

    lm_loss(model).backward()
    learner.step()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    for i in norm_index:
        assert torch.equal(learner.params[i], torch.ones_like(learner.params[i]))  # rounded away in bf16 ...
        moved = (learner.masters[i] - 1).abs()
        assert ((moved > 1e-3) & (moved < 1.6e-3)).float().mean() > 0.9  # ... but kept in the master
    for p, m in zip(learner.params, learner.masters):
        assert torch.equal(p, m.to(torch.bfloat16))  # the weights are the rounded masters
    for _ in range(4):
        lm_loss(model).backward()
        learner.step()
    assert any((learner.params[i] != 1).any() for i in norm_index)

    plain = torch.optim.AdamW(control.parameters(), lr=1.5e-3, weight_decay=0.0)
    for _ in range(5):
        lm_loss(control).backward()
        plain.step()
        plain.zero_grad()
    assert all(torch.equal(p, torch.ones_like(p)) for n, p in control.named_parameters() if "norm" in n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_identically(dtype: torch.dtype) -> None:
    def make(model: PreTrainedModel) -> Learner:
        return Learner(model, lr=1e-2, weight_decay=0.1, warmup_steps=2, total_steps=6, schedule="cosine")

    def steps(learner: Learner, k: int) -> None:
        for _ in range(k):
            lm_loss(learner.model).backward()
            learner.step()

    learner = make(make_tiny_model(dtype=dtype))
    steps(learner, 2)
    buffer = io.BytesIO()
    torch.save({"model": learner.model.state_dict(), "learner": learner.state_dict()}, buffer)
    steps(learner, 2)

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make(make_tiny_model(seed=5, dtype=dtype))  # different weights, overwritten below
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["learner"])
    steps(resumed, 2)
    assert resumed.lr == learner.lr
    for (name, p), q in zip(learner.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name
    for m, n in zip(learner.masters, resumed.masters):
        assert torch.equal(m, n)


# --- update_policy ---------------------------------------------------------------------------


class GradRecorder:
    """A Learner stand-in for update_policy: each step records the accumulated gradients, applies nothing."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self) -> float:
        self.grads.append({n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None})
        self.model.zero_grad(set_to_none=True)
        return 0.0


def make_groups(rewards_PG: list[list[float]], seed: int = 0) -> list[Group]:
    """Random prompts (3-6 tokens) and completions (1-7 tokens, some ending in EOS)."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for p, rewards in enumerate(rewards_PG):
        prompt = tuple(torch.randint(3, 259, (int(torch.randint(3, 7, (1,), generator=gen)),), generator=gen).tolist())
        samples = []
        for r in rewards:
            ids = torch.randint(3, 259, (int(torch.randint(1, 8, (1,), generator=gen)),), generator=gen).tolist()
            if r > 0:
                ids[-1] = EOS_ID
            c = Completion(token_ids=tuple(ids), logprobs=(-1.0,) * len(ids), finish_reason="stop", text="")
            samples.append(Sample(prompt_ids=prompt, completion=c, reward=r, reward_parts={"r": r}, prompt_index=p))
        groups.append(Group(prompt=f"prompt {p}", samples=tuple(samples)))
    return groups


GROUPS = [[1.0, 0.0, 0.0], [0.0, 1.0, 0.5]]


# Gradient identities (micro-batching, masking, skipping, sharding leave the gradient unchanged)
# are checked in float64, so that their tolerance does not depend on this CPU's summation order
# (SIMD width, threads). How much an order change is amplified is measured by the same tests in
# fp32: up to ~1e6 times fp32's unit roundoff (6e-8) on single elements, after the large SGD
# steps of the off-policy test. In float64 (unit roundoff 1.1e-16) that is ~1e-10 relative, so
# rtol = 1e-8 leaves a factor 100; atol = 1e-12 covers elements that are ~0. A wrong formula moves
# gradients by far more (test_padding_and_prompt_positions_do_not_contribute: ~1e-2).
EXACT = torch.float64


def exact_model() -> PreTrainedModel:
    return make_tiny_model(dtype=EXACT)


def recorded_grads(groups: list[Group], settings: UpdateSettings, pad_token_id: int = 0) -> list[dict[str, torch.Tensor]]:
    recorder = GradRecorder(exact_model())
    metrics = update_policy(recorder, groups, settings, pad_token_id=pad_token_id,  # type: ignore[arg-type]
                            generator=torch.Generator().manual_seed(0)).metrics
    assert all(math.isfinite(v) for v in metrics.values())
    return recorder.grads


def assert_grads_close(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for step_a, step_b in zip(a, b):
        for name in step_a:
            assert step_a[name].abs().max() > 0, name
            torch.testing.assert_close(step_a[name], step_b[name], atol=1e-12, rtol=1e-8)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mini_batches", [1, 2])
def test_micro_batch_size_does_not_change_the_gradient(aggregation: str, mini_batches: int) -> None:
    def grads(micro: int) -> list[dict[str, torch.Tensor]]:
        settings = UpdateSettings(loss=LossSettings(aggregation=aggregation, max_tokens=8, entropy_coef=0.01),
                                  passes=Passes(micro_batch_size=micro), mini_batches=mini_batches)
        return recorded_grads(make_groups(GROUPS), settings)

    whole = grads(6)
    assert len(whole) == mini_batches
    assert_grads_close(grads(1), whole)
    assert_grads_close(grads(4), whole)


def test_micro_batching_gives_the_same_parameters_after_a_learner_step() -> None:
    def params_after(micro: int) -> list[torch.Tensor]:
        learner = Learner(make_tiny_model(), lr=1e-5, weight_decay=0.0, grad_clip=0.0)
        settings = UpdateSettings(passes=Passes(micro_batch_size=micro))
        update_policy(learner, make_groups(GROUPS), settings, pad_token_id=0)
        return [p.detach().clone() for p in learner.model.parameters()]

    start = list(make_tiny_model().parameters())
    for p, q, p0 in zip(params_after(1), params_after(4), start):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=0)  # 1e-6 is a tenth of one Adam step
    assert any(not torch.equal(p, p0) for p, p0 in zip(params_after(4), start))


def test_equal_rewards_leave_parameters_unchanged() -> None:
    learner = Learner(make_tiny_model(), lr=1e-2, weight_decay=0.0, grad_clip=0.0)
    metrics = update_policy(learner, make_groups([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]),
                            UpdateSettings(passes=Passes(micro_batch_size=2)), pad_token_id=0).metrics
    assert metrics["advantage_abs_mean"] == 0.0 and metrics["grad_norm"] == 0.0
    for p, p0 in zip(learner.model.parameters(), make_tiny_model().parameters()):
        assert torch.equal(p, p0)


def test_constant_group_adds_no_gradient() -> None:
    """Under seq-mean-token-sum-norm the weights are fixed per token, so adding a constant group
    changes only the 1 / total_seqs factor: grad(both) = grad(varied alone) * 3 / 6."""
    settings = UpdateSettings(loss=LossSettings(aggregation="seq-mean-token-sum-norm", max_tokens=8),
                              passes=Passes(micro_batch_size=4))
    varied = make_groups([GROUPS[1]], seed=1)
    both = make_groups([[0.5, 0.5, 0.5]], seed=2) + varied
    g_varied, g_both = recorded_grads(varied, settings), recorded_grads(both, settings)
    assert_grads_close([{n: g * 0.5 for n, g in g_varied[0].items()}], g_both)


def test_padding_and_prompt_positions_do_not_contribute() -> None:
    """The gradient equals a plain per-sample reference loop over completion tokens only, and
    does not depend on the pad token id.

    With one optimizer step the old log-probs equal the current ones, so ppo_clip's per-token
    gradient is -A ∇logp; the entropy bonus adds -entropy_coef ∇H; token-mean divides the sum by
    the total number of completion tokens. (The entropy term matters here: the samples of a group
    share their prompt and GRPO's advantages sum to zero over a group, so a policy term leaking
    onto prompt positions would cancel out.)
    """
    groups = make_groups(GROUPS)
    settings = UpdateSettings(loss=LossSettings(entropy_coef=0.1), passes=Passes(micro_batch_size=3))
    got = recorded_grads(groups, settings, pad_token_id=0)
    assert_grads_close(recorded_grads(groups, settings, pad_token_id=200), got)

    model = exact_model()
    samples = [s for g in groups for s in g.samples]
    # GRPO's advantages as rlvr computes them (in float32; test_advantages checks them by hand)
    advantages = ESTIMATORS["grpo"](torch.tensor(GROUPS)).flatten()
    total_tokens = sum(len(s.completion.token_ids) for s in samples)
    for s, a in zip(samples, advantages.tolist()):
        ids = torch.tensor([s.prompt_ids + s.completion.token_ids])
        logp_TV = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        completion = slice(len(s.prompt_ids) - 1, None)  # logits at t score token t + 1
        lp_T = logp_TV.gather(-1, ids[0, 1:, None]).squeeze(-1)[completion]
        entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)[completion]
        ((-a * lp_T.sum() - 0.1 * entropy_T.sum()) / total_tokens).backward()
    assert_grads_close(got, [{n: p.grad for n, p in model.named_parameters() if p.grad is not None}])


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_zero_advantage_samples_are_skipped_without_changing_the_gradient(aggregation: str) -> None:
    """Samples of a constant group are not run (their policy-loss gradient is exactly zero); the
    gradient equals the one computed over every sample. A negligible entropy bonus (1e-30) forces
    the run over every sample for the reference."""
    groups = make_groups([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.0, 1.0, 0.5]])
    skip = UpdateSettings(loss=LossSettings(aggregation=aggregation, max_tokens=8), passes=Passes(micro_batch_size=2))
    every = UpdateSettings(loss=LossSettings(aggregation=aggregation, max_tokens=8, entropy_coef=1e-30),
                           passes=Passes(micro_batch_size=2))
    assert_grads_close(recorded_grads(groups, skip), recorded_grads(groups, every))
    metrics = update_policy(GradRecorder(make_tiny_model()), groups, skip, pad_token_id=0).metrics  # type: ignore[arg-type]
    # the constant group (3 samples) and the 0.5 of [0, 1, 0.5] (its group mean) have A = 0
    assert metrics["trained_fraction"] == pytest.approx(5 / 9)


def test_a_step_without_gradients_is_a_step_with_zero_gradients() -> None:
    """AdamW keeps moving on momentum with a zero gradient; a skipped (all-zero) mini-batch must too."""
    def run(second_grad_zero: bool) -> list[torch.Tensor]:
        learner = Learner(make_tiny_model(), lr=1e-2, weight_decay=0.1, grad_clip=0.0)
        for p in learner.model.parameters():
            p.grad = torch.ones_like(p)
        learner.step()
        if second_grad_zero:
            for p in learner.model.parameters():
                p.grad = torch.zeros_like(p)
        learner.step()  # otherwise: no gradient at all
        return [p.detach().clone() for p in learner.model.parameters()]

    for a, b in zip(run(True), run(False)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loss", sorted(set(LOSSES) - {"bapo", "clip_cov", "kl_cov"}))
@pytest.mark.parametrize("offpolicy", ["none", "tis"])
def test_micro_batch_size_does_not_change_the_gradient_of_any_loss(loss: str, offpolicy: str) -> None:
    """Two mini-batches with a large SGD step between them: the second is off-policy, so ratios,
    clipping and importance weights are exercised (the engine log-probs in make_groups are all
    -1, far from the model's, so tis truncates too). The documented exceptions compute a statistic
    of the batch they are given, i.e. per micro-batch, as their authors do: BAPO searches its clip
    bounds there, Clip-Cov and KL-Cov choose their tokens by covariance there."""
    def grads(micro: int) -> tuple[list[dict[str, torch.Tensor]], dict[str, float]]:
        # r2vpo's penalty is quadratic in an unclipped ratio: after a full-size SGD step the ratios
        # reach the hundreds and fp32 rounding of the forward pass is amplified past the tolerance;
        # a tenth of the step still moves the ratios well away from 1
        recorder = SGDRecorder(exact_model(), lr=0.1 if loss == "r2vpo" else 1.0)
        settings = UpdateSettings(loss=LossSettings(name=loss, offpolicy=offpolicy),
                                  passes=Passes(micro_batch_size=micro), mini_batches=2)
        metrics = update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                                generator=torch.Generator().manual_seed(0)).metrics
        return recorder.grads, metrics

    whole, metrics = grads(6)
    assert metrics["ratio_mean"] != pytest.approx(1.0, abs=1e-3)  # the second mini-batch was off-policy
    assert_grads_close(grads(1)[0], whole)
    assert_grads_close(grads(4)[0], whole)


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "gspo"])
def test_in_bf16_micro_batching_costs_no_more_than_bf16_itself(loss: str) -> None:
    """bf16 weights: each stored gradient element is rounded to 8 bits, and micro-batches add
    m - 1 roundings of the accumulated gradient. Against the exact gradient of the same weights
    (float64), the gradient with micro-batches of 1 must be as close as with one micro-batch of
    6, within the factor 3 of tests/precision.py (per tensor, in norm); and that deviation is
    rounding, not a formula: well under 10% (a forward and backward through 2 layers round each
    value some ten times, ~10 · 2^-8 ≈ 4% at worst)."""
    def grads(micro: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        model = make_tiny_model(dtype=torch.bfloat16).to(dtype)  # bf16 weights, exact in float64
        recorder = GradRecorder(model)
        settings = UpdateSettings(loss=LossSettings(name=loss, entropy_coef=0.01),
                                  passes=Passes(micro_batch_size=micro))
        update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                      generator=torch.Generator().manual_seed(0))
        return {n: g.double() for n, g in recorder.grads[0].items()}

    exact, whole, each = grads(6, torch.float64), grads(6, torch.bfloat16), grads(1, torch.bfloat16)
    for name, g in exact.items():
        rounding = float((whole[name] - g).norm())
        assert float((each[name] - g).norm()) <= 3 * rounding + 1e-12, name
        assert rounding <= 0.1 * float(g.norm()), name


class SGDRecorder(GradRecorder):
    """Records the gradients, then moves the weights by a plain SGD step of size `lr`."""

    def __init__(self, model: PreTrainedModel, lr: float = 1.0) -> None:
        super().__init__(model)
        self.lr = lr

    def step(self) -> float:
        with torch.no_grad():
            for p in self.model.parameters():
                if p.grad is not None:
                    p -= self.lr * p.grad
        return super().step()


def truncate(groups: list[Group], which: set[tuple[int, int]]) -> list[Group]:
    """Mark samples (group, index) as cut off by the token budget."""
    return [Group(g.prompt, tuple(dataclasses.replace(s, completion=dataclasses.replace(s.completion, finish_reason="length"))
                                  if (p, k) in which else s for k, s in enumerate(g.samples)), g.metadata)
            for p, g in enumerate(groups)]


def test_mask_truncated_leaves_cut_off_samples_out_of_the_loss() -> None:
    groups = truncate(make_groups(GROUPS), {(0, 0), (1, 2)})
    masked = UpdateSettings(loss=LossSettings(mask_truncated=True), passes=Passes(micro_batch_size=6))
    metrics = update_policy(GradRecorder(make_tiny_model()), groups, masked, pad_token_id=0).metrics  # type: ignore[arg-type]
    assert metrics["masked_truncated_fraction"] == pytest.approx(2 / 6)
    assert metrics["trained_fraction"] == pytest.approx(4 / 6)
    # it changes the gradient, and micro-batching still does not
    whole = recorded_grads(groups, masked)
    unmasked = recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6)))
    assert any(not torch.allclose(whole[0][n], unmasked[0][n]) for n in whole[0])
    masked_each = UpdateSettings(loss=LossSettings(mask_truncated=True), passes=Passes(micro_batch_size=1))
    assert_grads_close(recorded_grads(groups, masked_each), whole)
    # every sample cut off: nothing to train on
    everything = truncate(make_groups(GROUPS), {(p, k) for p in range(2) for k in range(3)})
    metrics = update_policy(GradRecorder(make_tiny_model()), everything, masked, pad_token_id=0).metrics  # type: ignore[arg-type]
    assert metrics["trained_fraction"] == 0.0 and metrics["masked_truncated_fraction"] == 1.0


def with_injected_tokens(groups: list[Group], seed: int = 1) -> list[Group]:
    """Give every completion of 3+ tokens an injected (loss mask 0) stretch in its middle, as a
    tool's output would be."""
    out = []
    for g in groups:
        samples = []
        for s in g.samples:
            n = len(s.completion.token_ids)
            mask = tuple(0 if 0 < t < n - 1 and n >= 3 else 1 for t in range(n))
            samples.append(dataclasses.replace(s, completion=dataclasses.replace(s.completion, loss_mask=mask)))
        out.append(Group(g.prompt, tuple(samples), g.metadata))
    return out


def test_injected_tokens_condition_but_are_not_trained() -> None:
    """On-policy GRPO with token-mean: the gradient is −(1/N) Σ_t A_i ∇log π(t) over the trained
    tokens only (N counts only them), with the injected tokens still in the context."""
    groups = with_injected_tokens(make_groups(GROUPS))
    assert any(0 in s.completion.loss_mask for g in groups for s in g.samples)  # type: ignore[operator]
    got = recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6)))
    model = exact_model()
    samples = [s for g in groups for s in g.samples]
    rewards = torch.tensor([g.rewards for g in groups])
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    total = sum(s.completion.trainable() for s in samples)
    loss = torch.zeros(())
    for s, a in zip(samples, adv):
        ids = torch.tensor([s.prompt_ids + s.completion.token_ids])
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1)
        p = len(s.prompt_ids)
        token_lp = logprobs[p - 1 :].gather(1, ids[0, p:, None])[:, 0]
        keep = torch.tensor(s.completion.loss_mask, dtype=torch.bool)
        loss = loss - a * token_lp[keep].sum() / total
    loss.backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(got[0][name], param.grad, atol=1e-6, rtol=1e-4, msg=name)
    # and the same samples trained on every token give a different gradient
    plain = recorded_grads(make_groups(GROUPS), UpdateSettings(passes=Passes(micro_batch_size=6)))
    assert any(not torch.allclose(plain[0][n], got[0][n]) for n in got[0])
    assert_grads_close(recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=1))), got)


def hand_grads(groups: list[Group], rows: list[tuple[Sample, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """−(1/N) Σ_rows Σ_t A_t ∇log π(t) over the trained tokens of every row (N counts them all)."""
    model = exact_model()
    total = sum(s.completion.trainable() for s, _ in rows)
    loss = torch.zeros(())
    for s, a_T in rows:
        ids = torch.tensor([s.prompt_ids + s.completion.token_ids])
        logprobs = torch.log_softmax(model(ids).logits[0, :-1], -1)
        p = len(s.prompt_ids)
        token_lp = logprobs[p - 1 :].gather(1, ids[0, p:, None])[:, 0]
        keep = torch.tensor(s.completion.loss_mask or (1,) * len(token_lp), dtype=torch.bool)
        loss = loss - (a_T * token_lp)[keep].sum() / total
    loss.backward()
    return {name: param.grad for name, param in model.named_parameters()}  # type: ignore[misc]


def test_a_summarised_episode_trains_every_segment_with_its_one_advantage() -> None:
    """SUPO: an episode's earlier segments are rows of their own (their own prompts), each
    trained with the episode's advantage; the group's advantages see one reward per episode."""
    groups = with_injected_tokens(make_groups(GROUPS))
    donor = make_groups([[0.0, 0.0, 0.0]], seed=7)[0].samples  # other prompts and completions
    segment = lambda k: (donor[k].prompt_ids, dataclasses.replace(donor[k].completion, loss_mask=None))  # noqa: E731
    first = dataclasses.replace(groups[0].samples[0], segments=(segment(0), segment(1)))
    third = dataclasses.replace(groups[1].samples[2], segments=(segment(2),))
    groups = [Group(groups[0].prompt, (first, *groups[0].samples[1:]), {}),
              Group(groups[1].prompt, (*groups[1].samples[:2], third), {})]
    got = recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6)))
    rewards = torch.tensor([g.rewards for g in groups])
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).flatten()
    rows = []
    for x, a in zip([x for g in groups for x in g.samples], adv):
        for prompt_ids, completion in x.segments:
            rows.append((Sample(prompt_ids, completion, x.reward, x.reward_parts, 0),
                         torch.full((len(completion.token_ids),), float(a))))
        rows.append((x, torch.full((len(x.completion.token_ids),), float(a))))
    assert len(rows) == 9
    want = hand_grads(groups, rows)
    for name, grad in want.items():
        torch.testing.assert_close(got[0][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    assert_grads_close(recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=1))), got)
    # the samples log gets one advantage per episode: the token mean over its segments
    result = update_policy(GradRecorder(make_tiny_model()), groups, UpdateSettings(), pad_token_id=0)  # type: ignore[arg-type]
    assert result.advantages[0][0] == pytest.approx(float(adv[0]), abs=1e-5)
    assert result.outcomes(groups)[0].advantages == result.advantages[0] and groups[0].advantages is None
    with pytest.raises(ValueError, match="summarised episodes"):
        update_policy(GradRecorder(make_tiny_model()), groups,
                      UpdateSettings(kl=KLSettings(coef=0.1, placement="reward")),
                      pad_token_id=0, ref_model=make_tiny_model())  # type: ignore[arg-type]


def test_turn_advantages_by_hand() -> None:
    from rlvr.algos import group_advantages, turn_advantages

    # three episodes: rewards per turn; returns-to-go (γ = 1): [1.2, 1.0], [0.2, 0.0, 0.0], [0.0]
    got = turn_advantages([[0.2, 1.0], [0.2, 0.0, 0.0], [0.0]])
    # turn 0: R = 1.2, 0.2, 0.0 → mean 0.4667, sample std 0.6429
    r0 = torch.tensor([1.2, 0.2, 0.0], dtype=torch.float64)
    a0 = ((r0 - r0.mean()) / (r0.std() + 1e-6)).tolist()
    # turn 1: R = 1.0, 0.0 → mean 0.5, std 0.7071 → ±0.7071; turn 2: one episode → 0
    assert got[0] == pytest.approx([a0[0], 0.5 / (0.5**0.5 + 1e-6)])
    assert got[1] == pytest.approx([a0[1], -0.5 / (0.5**0.5 + 1e-6), 0.0])
    assert got[2] == pytest.approx([a0[2]])
    assert a0 == pytest.approx([1.1406, -0.4147, -0.7259], abs=1e-4)
    # γ = 0.5: turn 0 returns 0.2 + 0.5, 0.2, 0.0; equal returns → 0
    half = turn_advantages([[0.2, 1.0], [0.2, 0.0]], gamma=0.5)
    assert half[0][0] == pytest.approx(0.25 / (0.25 * 2**0.5 + 1e-6)) and half[1][0] == pytest.approx(-half[0][0])
    assert turn_advantages([[1.0, 0.0], [1.0, 0.0]]) == [[0.0, 0.0], [0.0, 0.0]]
    # one turn each: exactly GRPO
    grpo = group_advantages(torch.tensor([[1.0, 0.0, 0.5]]))[0].tolist()
    assert [a[0] for a in turn_advantages([[1.0], [0.0], [0.5]])] == pytest.approx(grpo, abs=1e-5)


def test_turn_credit_gives_each_turn_its_own_advantage() -> None:
    """algo.credit = "turn": a token's advantage is its turn's (Completion.turn_index)."""
    groups = make_groups(GROUPS)
    turn_rewards = [[[0.0, 1.0], [0.0], [0.0]], [[0.0], [0.5, 0.5], [0.5]]]
    out = []
    for g, trs in zip(groups, turn_rewards):
        samples = []
        for x, tr in zip(g.samples, trs):
            n = len(x.completion.token_ids)
            index = tuple(min(t * len(tr) // n, len(tr) - 1) for t in range(n))
            samples.append(dataclasses.replace(x, completion=dataclasses.replace(x.completion, turn_index=index)))
        out.append(Group(g.prompt, tuple(samples), {"turn_rewards": trs}))
    got = recorded_grads(out, UpdateSettings(advantage=AdvantageSettings(credit="turn"),
                                             passes=Passes(micro_batch_size=6)))
    from rlvr.algos import turn_advantages

    rows = []
    for g in out:
        for x, adv in zip(g.samples, turn_advantages(g.metadata["turn_rewards"])):
            rows.append((x, torch.tensor([adv[t] for t in x.completion.turn_index], dtype=torch.float32)))
    assert any(len(set(a.tolist())) > 1 for _, a in rows)  # some episode's turns differ
    want = hand_grads(out, rows)
    for name, grad in want.items():
        torch.testing.assert_close(got[0][name], grad, atol=1e-6, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="turn rewards"):
        recorded_grads(make_groups(GROUPS), UpdateSettings(advantage=AdvantageSettings(credit="turn")))


def test_a_token_cap_cuts_micro_batches_without_changing_the_gradient() -> None:
    from rlvr.train.batches import micro_batches as _micro_batches

    groups = make_groups(GROUPS)
    samples = [x for g in groups for x in g.samples]
    lengths = {i: samples[i].num_tokens for i in range(len(samples))}
    cut = _micro_batches(list(range(len(samples))), samples, 6, max_tokens=20)
    assert sorted(i for m in cut for i in m) == list(range(len(samples))) and len(cut) > 1
    assert all(len(m) == 1 or len(m) * max(lengths[i] for i in m) <= 20 for m in cut)
    assert _micro_batches(list(range(6)), samples, 4) == _micro_batches(list(range(6)), samples, 4, None)
    assert_grads_close(recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6, micro_batch_tokens=12))),
                       recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6))))


def reference_grads(groups: list[Group], keep: Callable[[float, torch.Tensor], torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """The gradient of plain per-sample REINFORCE over completion tokens, token-mean over every
    completion token, with each sample's tokens weighted by ``keep(advantage, entropy_T)``."""
    model = exact_model()
    samples = [s for g in groups for s in g.samples]
    advantages = ESTIMATORS["grpo"](torch.tensor([g.rewards for g in groups])).flatten()
    total_tokens = sum(len(s.completion.token_ids) for s in samples)
    for s, a in zip(samples, advantages.tolist()):
        ids = torch.tensor([s.prompt_ids + s.completion.token_ids])
        logp_TV = model(input_ids=ids).logits[0, :-1].log_softmax(-1)
        completion = slice(len(s.prompt_ids) - 1, None)
        lp_T = logp_TV.gather(-1, ids[0, 1:, None]).squeeze(-1)[completion]
        entropy_T = -(logp_TV.exp() * logp_TV).sum(-1)[completion].detach()
        ((-a * lp_T * keep(a, entropy_T)).sum() / total_tokens).backward()
    return [{n: p.grad for n, p in model.named_parameters() if p.grad is not None}]


def test_high_entropy_selection_trains_only_the_top_tokens_of_the_forward_pass() -> None:
    """algo.entropy = {top = 0.3}: the policy gradient of the tokens whose entropy is at or above
    the 0.7-quantile of all trained tokens of the pass (one micro-batch here), over the same
    token count as without it."""
    groups = make_groups(GROUPS)
    got = recorded_grads(groups, UpdateSettings(loss=LossSettings(entropy_top=0.3), passes=Passes(micro_batch_size=6)))
    model = exact_model()
    entropies = []
    with torch.no_grad():
        for s in (s for g in groups for s in g.samples):
            logp_TV = model(input_ids=torch.tensor([s.prompt_ids + s.completion.token_ids])).logits[0, :-1].log_softmax(-1)
            entropies.append(-(logp_TV.exp() * logp_TV).sum(-1)[len(s.prompt_ids) - 1:])
    threshold = torch.quantile(torch.cat(entropies), 0.7)
    assert_grads_close(got, reference_grads(groups, lambda a, entropy_T: (entropy_T >= threshold).to(EXACT)))
    every = recorded_grads(groups, UpdateSettings(passes=Passes(micro_batch_size=6)))[0]
    assert any(not torch.allclose(got[0][name], every[name]) for name in every)


def test_opsm_drops_the_negative_samples_that_drifted_from_the_sampler() -> None:
    """The samples were "sampled" at log-prob -1 per token, far above the tiny model's (~-5.5):
    every row has drifted past δ = 1, so OPSM keeps exactly the rows with a positive advantage
    (the correction's advantages and log-probs come from the update itself)."""
    groups = make_groups(GROUPS)
    got = recorded_grads(groups, UpdateSettings(loss=LossSettings(offpolicy="opsm", offpolicy_kwargs={"delta": 1.0}),
                                                passes=Passes(micro_batch_size=2)))
    assert_grads_close(got, reference_grads(groups, lambda a, entropy_T: torch.full_like(entropy_T, float(a >= 0))))
    kept_all = recorded_grads(groups, UpdateSettings(loss=LossSettings(offpolicy="opsm",
                                                                       offpolicy_kwargs={"delta": 100.0}),
                                                     passes=Passes(micro_batch_size=2)))
    assert_grads_close(kept_all, reference_grads(groups, lambda a, entropy_T: torch.ones_like(entropy_T)))


def test_before_the_first_optimizer_step_the_ratio_is_exactly_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """With several mini-batches the old log-probs are scored before the update, in a pass whose
    micro-batching may round differently from the training pass's. The first mini-batch must still
    see log r = 0 exactly (the policy has not moved), or a loss with a kink at r = 1 (KL-Cov's
    |log r|) takes its gradient's sign from rounding; later mini-batches see the scored ones."""
    seen: list[torch.Tensor] = []
    ppo = LOSSES["ppo_clip"]

    def recording(x: LossInputs, **kw: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        seen.append((x.logprobs.detach() - x.old)[x.mask.bool()])
        return ppo(x, **kw)

    monkeypatch.setitem(LOSSES, "ppo_clip", recording)
    recorder = SGDRecorder(exact_model(), lr=1.0)
    steps: list[int] = []  # how many forward passes the loss had seen at each optimizer step
    step = recorder.step
    monkeypatch.setattr(recorder, "step", lambda: (steps.append(len(seen)), step())[1])
    # the scoring pass runs all six rows together, the training pass each mini-batch's three: on
    # this batch their roundings differ (the ratio was ~1e-16 away from 1 before 4182e12)
    settings = UpdateSettings(loss=LossSettings(name="ppo_clip"), passes=Passes(micro_batch_size=8), mini_batches=2)
    update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                  generator=torch.Generator().manual_seed(0))
    assert len(steps) == 2 and 0 < steps[0] < len(seen)
    assert all(bool((d == 0).all()) for d in seen[: steps[0]])
    assert any(bool((d != 0).any()) for d in seen[steps[0]:])  # the SGD step moved the policy


@pytest.mark.dtype_independent
def test_token_rows_puts_per_sample_values_on_the_micro_batch_device() -> None:
    """Per-sample advantages and log-probs stay on the CPU; the micro-batch runs where the model
    is. A fake CUDA mask (no GPU needed) makes a device mix raise as it did on a real H200,
    where `train.device = "cuda"` failed at the first update before the values were moved."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlvr.train.batches import token_rows

    with FakeTensorMode(allow_non_fake_inputs=True):
        mask_BT = torch.tensor([[False, True, True], [True, True, False]], device="cuda")
        out_BT = token_rows([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [0, 1], mask_BT)
        assert out_BT.device.type == "cuda" and out_BT.shape == (2, 3)
    mask_BT = torch.tensor([[False, True, True], [True, True, False]])  # and on the CPU, the values themselves
    assert token_rows([torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])], [0, 1], mask_BT).tolist() == \
        [[0.0, 1.0, 2.0], [3.0, 4.0, 0.0]]


@pytest.mark.dtype_independent
def test_token_rows_joins_rows_scored_on_the_device_with_rows_stored_on_the_cpu() -> None:
    """A replayed or demonstration row's old log-probs are its stored ones (CPU) while a fresh
    row's come from a scoring pass on the model's device: one micro-batch can hold both."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from rlvr.train.batches import token_rows

    with FakeTensorMode(allow_non_fake_inputs=True):
        mask_BT = torch.ones(2, 2, dtype=torch.bool, device="cuda")
        scored = torch.zeros(2, device="cuda")
        out_BT = token_rows([torch.tensor([1.0, 2.0]), scored], [0, 1], mask_BT)
        assert out_BT.device.type == "cuda"


def test_a_gradient_that_is_not_finite_is_not_applied(caplog: pytest.LogCaptureFixture) -> None:
    """A nan reward reached the advantages and the gradient unchecked from some environments (a
    red-team review, session 19): one such step wrote nan into every weight. It is skipped now."""
    model = make_tiny_model()
    learner = Learner(model, lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    logits = model(torch.tensor([[3, 4, 5]])).logits
    (logits.sum() * float("nan")).backward()
    with caplog.at_level("WARNING"):
        assert math.isnan(learner.step())
    assert learner.skipped_steps == 1 and "skipped" in caplog.text
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    model(torch.tensor([[3, 4, 5]])).logits.sum().backward()
    assert math.isfinite(learner.step()) and not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_skipped_optimizer_steps_are_a_metric() -> None:
    from rlvr.train.update import _TOKEN_METRICS, _summary

    def sums() -> dict[str, float]:
        return {"_tokens": 4.0, "_loss": 2.0, **dict.fromkeys(_TOKEN_METRICS, 0.0)}

    assert _summary(sums(), [1.0, float("nan")], False, [])["skipped_optimizer_steps"] == 1.0
    assert "skipped_optimizer_steps" not in _summary(sums(), [1.0, 2.0], False, [])
