"""AdamW with compact moments: 3 bytes a weight of optimizer state instead of 8.

AdamW keeps two fp32 moments per trained weight: 1.08 GB on SmolLM2-135M, as much as its fp32
weights and gradients together. `train.optimizer = "adamw_compact"` keeps the first moment in one
byte and the second in two (0.40 GB there). The step is AdamW's ("Decoupled Weight Decay
Regularization", Loshchilov & Hutter, arXiv:1711.05101; the arithmetic and bias correction of
torch.optim.AdamW), in fp32 on the decoded moments: only what is kept between steps is compact.

Storage is block-wise, the idea of "8-bit Optimizers via Block-wise Quantization" (Dettmers et
al., arXiv:2110.02861): each block of 256 consecutive values is coded relative to its own largest
value, so one large value costs precision only in its block. The code is ours: a float whose
exponent the block shares. A code counts levels down from the block's top octave, 2^b levels per
octave (fp32's top b mantissa bits), so encoding and decoding are shifts of the fp32 bit pattern.

- First moment: int8, a sign and 127 levels, b = 3 (15 octaves; a smaller value rounds to 0 or
  the lowest level, unbiased).
- Second moment: int16, 32,767 levels, b = 10 (31 octaves; a positive value never becomes 0,
  which would divide a surviving first moment by eps, but at least the lowest level). A gradient
  over 2^15.5 times its block's others makes their second moments this floor, which shrinks
  their steps until it decays: the price of sharing an exponent.

Rounding onto the levels is stochastic ("Deep Learning with Limited Numerical Precision", Gupta
et al., arXiv:1502.02551): random low bits are added to the fp32 pattern before it is truncated,
so a value between two levels becomes either with the probabilities that keep it unbiased.
Rounding to the nearest level would freeze a moment whose change per step is below half a level:
the second moment changes by (1 − β2) = 0.1% of itself with the default betas. But each step's
rounding error is carried into the next step scaled by β, so the errors add up over the moment's
memory, 1 / (1 − β²) steps. One rounding's standard deviation is at most 2^-(b+1) of the value,
so the stored second moment's accumulated error is at most ~1.1% (sd) at β2 = 0.999 with b = 10,
and the first moment's ~14% at β1 = 0.9 with b = 3, far below the noise of a sampled gradient.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

BLOCK = 256
"""Values sharing one exponent."""
CHUNK = 1 << 17
"""Values decoded, stepped and re-encoded at a time: bounds the fp32 temporaries to 512 KB each."""


@dataclass(frozen=True)
class Code:
    """A block-floating-point code: `bits` mantissa bits, codes 0..top (top + 1 a power of two)."""

    bits: int
    top: int

    @property
    def dropped(self) -> int:
        return 23 - self.bits

    @property
    def offset(self) -> int:
        """code = (fp32 pattern >> dropped) - offset, for values scaled so the top octave is [1, 2)."""
        return (127 << self.bits) - (self.top + 1) + (1 << self.bits)

    def positive(self, codes: torch.Tensor) -> torch.Tensor:
        """The values of codes 1..top (int32), top octave [1, 2)."""
        return ((codes + self.offset) << self.dropped).view(torch.float32)

    def levels(self) -> torch.Tensor:
        """Code -> value (top octave [1, 2)), for codes -top..top: 0 at the middle, negatives negative."""
        up = self.positive(torch.arange(1, self.top + 1, dtype=torch.int32))
        return torch.cat([-up.flip(0), torch.zeros(1), up])


FIRST, SECOND = Code(bits=3, top=127), Code(bits=10, top=32767)
_FIRST_LEVELS: dict[torch.device, torch.Tensor] = {}  # the first moment's code -> value table, per device
_LOWEST = {code: code.positive(torch.tensor(1, dtype=torch.int32)) for code in (FIRST, SECOND)}  # code 1's value


def _power_of_two(exponent: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32, for biased fp32 exponents e (int32, 1..254; 0 gives 0)."""
    return (exponent << 23).view(torch.float32)


def encode(x: torch.Tensor, noise: torch.Tensor, code: Code, *, floor: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Code non-negative fp32 values [blocks, BLOCK], rounding stochastically with `noise`
    (uniform int32 in [0, 2^code.dropped), same shape): (codes int32 in floor..top, 0 for zero; each
    block's top octave as a biased fp32 exponent, uint8). With floor 0, a value under the lowest
    level codes 1 with the probability value / lowest level, else 0: unbiased down to zero; with
    floor 1 it codes 1."""
    largest = x.amax(dim=1)
    bad = ~torch.isfinite(largest)
    if bad.any():  # an inf or NaN codes `top` (its weight is NaN anyway), the rest as usual
        largest[bad] = torch.nan_to_num(x[bad], nan=0.0, posinf=0.0).amax(dim=1)
    # The top octave is the one holding the block's largest value after rounding: a value at or
    # above the octave's last level may round up to the next power of two. 2^-111..2^126 keeps
    # the exponents and the scale below normal numbers.
    largest = largest.div_(1 - 2.0 ** -(code.bits + 1)).clamp_(2.0**-111, 2.0**126)
    exponent = largest.view(torch.int32) >> 23
    scaled = x * _power_of_two(254 - exponent)[:, None]  # top octave -> [1, 2): exact, a power of two
    q = (scaled.view(torch.int32) + noise) >> code.dropped
    codes = q.sub_(code.offset).clamp_(floor, code.top)
    if floor == 0:
        # under the lowest level (code 1), the octave's rounding would use a level that code 0 does
        # not decode to: round between 0 and the lowest level instead, the noise as a fraction
        lowest = float(_LOWEST[code])
        under = scaled < lowest
        if under.any():
            codes.mul_(~under).add_(under & (noise * (lowest / (1 << code.dropped)) < scaled))
    return codes, exponent.to(torch.uint8)


def decode_first(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """fp32 values [blocks, BLOCK] of signed int8 codes (0 = zero) and their blocks' exponents."""
    if codes.device not in _FIRST_LEVELS:
        _FIRST_LEVELS[codes.device] = FIRST.levels().to(codes.device)
    levels = _FIRST_LEVELS[codes.device]
    values = levels.index_select(0, codes.view(-1).to(torch.int32).add_(FIRST.top))
    return values.view(codes.shape).mul_(_power_of_two(exponent.to(torch.int32))[:, None])


def decode_second(codes: torch.Tensor, exponent: torch.Tensor) -> torch.Tensor:
    """fp32 values [blocks, BLOCK] of int16 codes (1..top) and their blocks' exponents."""
    values = (codes.to(torch.int32).add_(SECOND.offset) << SECOND.dropped).view(torch.float32)
    return values.mul_(_power_of_two(exponent.to(torch.int32))[:, None])


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


class CompactAdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update with compact moments (see the module docstring). Per weight
    tensor the state is `m` (int8), `v` (int16), their blocks' exponents (uint8) and `step`. The
    rounding draws from the optimizer's own generator (`seed`), saved in its state_dict, so a
    resumed run rounds exactly as an uninterrupted one."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0) -> None:
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        """The rounding's generator on a device type (one per type: every rank and GPU of a
        data-parallel run draws the same noise, so replicas stay equal)."""
        if device.type not in self._generators:
            self._generators[device.type] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device.type]

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["rounding"] = {kind: g.get_state() for kind, g in self._generators.items()}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load casts floating-point parameters' state to their dtype: the codes are set
        aside and put back in their own dtypes, on their weights' devices."""
        state_dict = dict(state_dict)
        rounding = state_dict.pop("rounding", {})
        saved = state_dict["state"]
        state_dict["state"] = {i: {"step": s["step"]} for i, s in saved.items()}
        super().load_state_dict(state_dict)
        ids = (i for group in state_dict["param_groups"] for i in group["params"])
        weights = (p for group in self.param_groups for p in group["params"])
        for i, p in zip(ids, weights):
            if i in saved:
                self.state[p].update({k: t.to(p.device) for k, t in saved[i].items() if k != "step"})
        for kind, generator_state in rounding.items():
            # a checkpoint from another kind of device rounds on from a fresh stream here
            if kind == "cpu" or (kind == "cuda" and torch.cuda.is_available()):
                self._generator(torch.device(kind)).set_state(generator_state)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("CompactAdamW.step takes no closure")
        # one draw of noise per step and device, 4 chunks' worth, read at random offsets: each value's
        # rounding stays uniform and independent of the value, for a small fraction of a draw each
        pools: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.device not in pools:
                    pool = torch.randint(0, 1 << FIRST.dropped, (4 * CHUNK,), dtype=torch.int32, device=p.device,
                                         generator=self._generator(p.device))
                    pools[p.device] = pool, pool >> FIRST.dropped - SECOND.dropped
                self._step_one(p, p.grad, group, *pools[p.device])
        return None

    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            if p.dtype != torch.float32:
                raise ValueError(f"CompactAdamW steps fp32 weights, got {p.dtype} (the learner gives it fp32 masters)")
            if not p.is_contiguous():
                raise ValueError(f"CompactAdamW steps contiguous weights, got one of shape {tuple(p.shape)} "
                                 f"and strides {p.stride()}")
            blocks, device = _blocks(p.numel()), p.device
            state.update(step=0, m=torch.zeros(blocks * BLOCK, dtype=torch.int8, device=device),
                         v=torch.zeros(blocks * BLOCK, dtype=torch.int16, device=device),
                         m_exponent=torch.zeros(blocks, dtype=torch.uint8, device=device),
                         v_exponent=torch.zeros(blocks, dtype=torch.uint8, device=device))
        return state

    def _step_one(self, p: torch.Tensor, grad: torch.Tensor, group: dict[str, Any], m_pool: torch.Tensor,
                  v_pool: torch.Tensor) -> None:
        state = self._state(p)
        state["step"] += 1
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        step_size = lr / (1 - beta1 ** state["step"])
        v_correction = math.sqrt(1 - beta2 ** state["step"])
        first = state["step"] == 1  # the moments start at exactly zero
        weights, grads = p.view(-1), grad.reshape(-1)
        n = weights.numel()
        chunks, padded_n = -(-n // CHUNK), _blocks(n) * BLOCK
        offsets = torch.randint(0, m_pool.numel() - min(CHUNK, padded_n) + 1, (2 * chunks,),
                                generator=self._generator(torch.device("cpu"))).tolist()
        for i, start in enumerate(range(0, n, CHUNK)):
            end = min(n, start + CHUNK)
            blocks = slice(start // BLOCK, _blocks(end))
            padded = slice(start, blocks.stop * BLOCK)
            w, g = weights[start:end], grads[start:end].float()
            if first:
                m, v = torch.zeros_like(w), torch.zeros_like(w)
            else:
                m = decode_first(state["m"][padded].view(-1, BLOCK), state["m_exponent"][blocks]).view(-1)[: end - start]
                v = decode_second(state["v"][padded].view(-1, BLOCK), state["v_exponent"][blocks]).view(-1)[: end - start]
            if decay:
                w.mul_(1 - lr * decay)
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w.addcdiv_(m, v.sqrt().div_(v_correction).add_(eps), value=-step_size)
            size = padded.stop - padded.start
            if size > end - start:  # the tensor's last, partial block
                m, v = (torch.nn.functional.pad(x, (0, size - x.numel())) for x in (m, v))
            m_noise = m_pool[offsets[2 * i] : offsets[2 * i] + size].view(-1, BLOCK)
            v_noise = v_pool[offsets[2 * i + 1] : offsets[2 * i + 1] + size].view(-1, BLOCK)
            self._store(state, padded, blocks, m.view(-1, BLOCK), v.view(-1, BLOCK), m_noise, v_noise)

    @staticmethod
    def _store(state: dict[str, Any], padded: slice, blocks: slice, m: torch.Tensor, v: torch.Tensor,
               m_noise: torch.Tensor, v_noise: torch.Tensor) -> None:
        codes, state["m_exponent"][blocks] = encode(m.abs(), m_noise, FIRST)
        sign = m.view(torch.int32) >> 31  # -1 where negative, else 0
        state["m"][padded] = codes.bitwise_xor_(sign).sub_(sign).view(-1)  # two's complement: -codes where negative
        codes, state["v_exponent"][blocks] = encode(v, v_noise, SECOND, floor=1)
        state["v"][padded] = codes.view(-1)
