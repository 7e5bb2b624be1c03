"""rlvr.train.compact_adamw: the codes (each value decodes to a level that brackets it, rounding
is unbiased), AdamW's first step exactly, moments that track a constant gradient over the second
moment's whole memory, and the Learner with train.optimizer = "adamw_compact" (steps, resumes
identically, refuses another optimizer's checkpoint). Bounds come from the codes' spacing: with b
mantissa bits, two adjacent levels around x are at most x * 2^-b apart, so one stochastic rounding
errs by at most that and has a standard deviation of at most half of it."""

from __future__ import annotations

import io

import pytest
import torch

from rlvr.train.compact_adamw import BLOCK, FIRST, SECOND, CompactAdamW, Code, decode_first, decode_second, encode
from rlvr.train.learner import Learner
from tests.test_learner import lm_loss
from tests.tiny import make_tiny_model

CODES = [(FIRST, decode_first, torch.int8), (SECOND, decode_second, torch.int16)]


def spread(blocks: int, octaves: int, seed: int = 0) -> torch.Tensor:
    """Positive values [blocks, BLOCK], log-uniform over `octaves` octaves below each block's scale
    (itself varying by 2^±40 across blocks), so every octave of the code is exercised."""
    gen = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-40, 40, (blocks, 1), generator=gen).float())
    return scale * torch.exp2(-octaves * torch.rand(blocks, BLOCK, generator=gen))


def roundings(x: torch.Tensor, code: Code, decode, dtype: torch.dtype, seed: int) -> torch.Tensor:
    noise = torch.randint(0, 1 << code.dropped, x.shape, dtype=torch.int32, generator=torch.Generator().manual_seed(seed))
    codes, exponent = encode(x, noise, code)
    return decode(codes.to(dtype), exponent)


@pytest.mark.parametrize("code, decode, dtype", CODES)
def test_each_value_decodes_to_a_level_at_most_one_spacing_away(code: Code, decode, dtype: torch.dtype) -> None:
    octaves = 14 if code is FIRST else 30  # inside the grid: 15 and 31 octaves
    x = spread(64, octaves)
    for seed in range(3):
        d = roundings(x, code, decode, dtype, seed)
        assert ((d - x).abs() <= x * 2.0**-code.bits).all()
    codes, _ = encode(torch.zeros(2, BLOCK), torch.zeros(2, BLOCK, dtype=torch.int32), code)  # floor 0
    assert (codes == 0).all()  # the first moment's 0 decodes to 0; the optimizer stores no second-moment 0


def test_the_first_moment_keeps_its_sign() -> None:
    x = spread(8, 14) * torch.where(torch.rand(8, BLOCK) < 0.5, -1.0, 1.0)
    noise = torch.randint(0, 1 << FIRST.dropped, x.shape, dtype=torch.int32)
    codes, exponent = encode(x.abs(), noise, FIRST)
    d = decode_first(torch.where(x < 0, -codes, codes).to(torch.int8), exponent)
    assert (torch.sign(d) == torch.sign(x)).all()


@pytest.mark.parametrize("code, decode, dtype", CODES)
def test_stochastic_rounding_is_unbiased(code: Code, decode, dtype: torch.dtype) -> None:
    """The mean of n roundings is within 6 standard deviations of x: sd <= x * 2^-(b+1) / sqrt(n).
    Rounding to the nearest level (or truncating) errs by up to half a spacing at every value."""
    x, n = spread(16, 12), 1000
    total = torch.zeros_like(x)
    for seed in range(n):
        total += roundings(x, code, decode, dtype, seed)
    assert ((total / n - x).abs() <= 6 * x * 2.0 ** -(code.bits + 1) / n**0.5).all()


def test_the_first_step_is_adamw_exactly() -> None:
    """The moments start at zero, so step 1 is AdamW's arithmetic on exact moments: bit for bit
    torch's per-tensor AdamW, which computes the same operations in the same order."""
    gen = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(1000, generator=gen), torch.randn(1000, generator=gen)
    results = []
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False),
                 lambda p: CompactAdamW(p, lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)):
        w = w0.clone().requires_grad_(True)
        w.grad = grad.clone()
        make([w]).step()
        results.append(w.detach())
    assert torch.equal(results[1], results[0])  # the same operations in the same order
    assert not torch.equal(results[1], w0)


@pytest.mark.dtype_independent  # no model: the optimizer's own storage
def test_the_moments_track_a_constant_gradient_over_the_second_moments_memory() -> None:
    """3,000 steps of one gradient (values inside both grids). Each step's rounding error is
    carried on scaled by beta, so the stored moment's error has sd <= 2^-(b+1) / sqrt(1 - beta^2)
    of the value: 1.1% for the second moment (b = 10, beta2 = 0.999), checked per value at 6 sd;
    14.3% for the first (b = 3, beta1 = 0.9), checked on the mean of 4,096 values at 6 sd. A
    second moment rounded to the nearest level would stop growing at about two thirds of g^2."""
    gen = torch.Generator().manual_seed(0)
    g = torch.exp2(-4 * torch.rand(4096, generator=gen)) * torch.where(torch.rand(4096, generator=gen) < 0.5, -1.0, 1.0)
    w = torch.zeros(4096, requires_grad=True)
    optimizer, steps = CompactAdamW([w], lr=1e-9), 3000
    for _ in range(steps):
        w.grad = g.clone()
        optimizer.step()
    state = optimizer.state[w]
    m = decode_first(state["m"].view(-1, BLOCK), state["m_exponent"]).view(-1)
    v = decode_second(state["v"].view(-1, BLOCK), state["v_exponent"]).view(-1)
    m_exact, v_exact = g * (1 - 0.9**steps), g * g * (1 - 0.999**steps)
    assert ((v / v_exact - 1).abs() <= 6 * 2.0**-11 / (1 - 0.999**2) ** 0.5).all()
    assert abs(float((m / m_exact - 1).mean())) <= 6 * 2.0**-4 / (1 - 0.9**2) ** 0.5 / 4096**0.5


def test_the_state_is_three_bytes_a_weight_and_stays_so_after_a_reload() -> None:
    """torch's Optimizer.load_state_dict casts a float weight's state to its dtype: the codes must
    come back as codes, not as 4-byte floats."""
    def state_bytes(optimizer: CompactAdamW, w: torch.Tensor) -> int:
        state = optimizer.state[w]
        assert (state["m"].dtype, state["v"].dtype, state["m_exponent"].dtype) == (torch.int8, torch.int16, torch.uint8)
        return sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))

    w = torch.zeros(3 * BLOCK + 5, requires_grad=True)  # a partial last block
    w.grad = torch.randn_like(w)
    optimizer = CompactAdamW([w])
    optimizer.step()
    optimizer.step()
    blocks = 4
    assert state_bytes(optimizer, w) == 3 * blocks * BLOCK + 2 * blocks
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    buffer.seek(0)
    reloaded = CompactAdamW([w])
    reloaded.load_state_dict(torch.load(buffer))
    assert state_bytes(reloaded, w) == 3 * blocks * BLOCK + 2 * blocks
    for key in ("m", "v", "m_exponent", "v_exponent"):
        assert torch.equal(reloaded.state[w][key], optimizer.state[w][key])


def test_the_first_moment_is_unbiased_below_its_lowest_level() -> None:
    """Under the lowest level a value codes 0 or the lowest level: its mean over n roundings is
    within 6 sd (sd <= lowest / 2 / sqrt(n)) of it. Truncating it to 0 would miss by all of it."""
    x = torch.zeros(8, BLOCK)
    x[:, 0] = 1.0  # each block's largest: its top octave is [1, 2)
    lowest = float(decode_first(torch.ones(1, 1, dtype=torch.int8), torch.tensor([127], dtype=torch.uint8)))
    x[:, 1:] = torch.linspace(0.05, 1.1, BLOCK - 1) * lowest
    n = 2000
    total = torch.zeros_like(x)
    for seed in range(n):
        total += roundings(x, FIRST, decode_first, torch.int8, seed)
    assert ((total / n - x)[:, 1:].abs() <= 6 * lowest / 2 / n**0.5).all()


def test_a_nan_gradient_spoils_its_own_weight_only() -> None:
    """As with torch's AdamW, not the other 255 weights of its block."""
    w = torch.ones(2 * BLOCK, requires_grad=True)
    optimizer = CompactAdamW([w], lr=1e-2)
    for bad in (float("nan"), 1.0, float("inf"), 1.0):
        w.grad = torch.ones_like(w)
        w.grad[3] = bad
        optimizer.step()
    finite = torch.isfinite(w.detach())
    assert not finite[3] and finite.sum() == 2 * BLOCK - 1


# --- the learner ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_learner_trains_and_resumes_identically_with_compact_moments(dtype: torch.dtype) -> None:
    def make(model) -> Learner:
        return Learner(model, lr=1e-2, weight_decay=0.1, optimizer="adamw_compact")

    def steps(learner: Learner, first: int, k: int) -> list[float]:
        losses = []
        for i in range(first, first + k):
            loss = lm_loss(learner.model)
            loss.backward()
            learner.step()
            losses.append(float(loss.detach()))
        return losses

    learner = make(make_tiny_model(dtype=dtype))
    losses = steps(learner, 0, 3)
    assert losses[-1] < losses[0]  # it learns the fixed batch
    buffer = io.BytesIO()
    torch.save({"model": learner.model.state_dict(), "learner": learner.state_dict()}, buffer)
    steps(learner, 3, 2)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = make(make_tiny_model(seed=5, dtype=dtype))
    resumed.model.load_state_dict(saved["model"])
    resumed.load_state_dict(saved["learner"])
    steps(resumed, 3, 2)
    for (name, p), q in zip(learner.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_a_checkpoint_of_another_optimizer_is_refused_by_name() -> None:
    learner = Learner(make_tiny_model(), lr=1e-2)
    lm_loss(learner.model).backward()
    learner.step()
    compact = Learner(make_tiny_model(), lr=1e-2, optimizer="adamw_compact")
    with pytest.raises(ValueError, match="resume with train.optimizer = 'adamw'"):
        compact.load_state_dict(learner.state_dict())
    with pytest.raises(ValueError, match="unknown optimizer 'sgd'"):
        Learner(make_tiny_model(), lr=1e-2, optimizer="sgd")


def test_a_compact_step_marks_every_weight_changed() -> None:
    """The engine's static decoder sees stale weight copies by their version counters."""
    model = make_tiny_model()
    learner = Learner(model, lr=1e-2, optimizer="adamw_compact")
    before = [p._version for p in model.parameters()]
    lm_loss(model).backward()
    learner.step()
    assert all(p._version > v for p, v in zip(model.parameters(), before))
