"""The static decoder's weights, and the formats it can hold them in.

`FusedWeights` takes a model's current parameters, with the query, key and value projections
fused into one matrix and the MLP's gate and up projections into another. Each projection is a
`Dense` on the model's own numbers, in the forms (rlvr.rollout.forms) that the plans measured on
this CPU name for each row count (rlvr.rollout.plans); or, with `engine.dtype` "float16" or
"int8", a `Float16` or `Int8` copy.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence

import torch
from transformers import PreTrainedModel

from rlvr.rollout.forms import FORMS, Plan, bucket, eager_plan, fused_bias, fused_parts, joined, waiting, without_fp16
from rlvr.rollout.plans import PROBED_DTYPES, Plans, fixed_plan, product_plans

log = logging.getLogger(__name__)


LAZY_AFTER = 16
"""The one-row steps a decode call runs before its lazy forms (`Form.lazy`) take over, unless it
starts with one row and asks for at least this many tokens (`StaticDecoder`). Making the bundled
model's float16 copies takes about what 9-18 one-row decode steps save with them (0.044-0.09 s
against ~5 ms a step, bf16 on a Zen 4 EPYC; docs/LOG.md, session 17): so a GRPO step whose last
sample decodes alone for a few steps makes no copy it would barely use, and serving or
evaluating one row at a time uses the copy throughout. Counted per call, so a call's numbers depend only on
its own inputs, never on what the engine decoded before (a resumed run gets the same)."""


class LazySwitch:
    """Whether the lazy forms of the `Dense` projections sharing it run now (the decoder sets it
    each step, `LAZY_AFTER`); `warned`: the weights changed before a lazy copy was made, said once."""

    def __init__(self, on: bool = True) -> None:
        self.on, self.warned = on, False


class Dense:
    """A projection on the model's own numbers, in the form its `Plan` names for the row count:
    the weights kept are those of the forms the plan uses (`FORMS`). Without a plan, `fixed_plan`.
    Every form is the same product of the same weight, summed in another order (and, for
    "half", its result rounded to float16 before the model's dtype).

    ``weight`` is the [out, in] weight, or the weights whose rows it is made of (q, k and v; gate
    and up), kept as they are and joined only to make a form's copy. A lazy form (`Form.lazy`)
    runs only while ``switch`` is on (always, without one); its rows run in the plan's nearest
    other form (`eager_plan`) meanwhile. Its copy is made when it first runs, unless the weights
    changed since the others were made (their version counters moved): the copy would then hold
    other numbers, so those rows keep to the other form.

    ``bias``: added inside the product where the form can (`Form`), as `nn.Linear` adds it."""

    def __init__(self, weight: torch.Tensor | Sequence[torch.Tensor], plan: Plan | None = None,
                 switch: LazySwitch | None = None, bias: torch.Tensor | None = None) -> None:
        parts = [weight.detach()] if isinstance(weight, torch.Tensor) else [w.detach() for w in weight]
        self.bias = None if bias is None else bias.detach()
        self.plan = plan or fixed_plan(parts[0])
        self.lazy = waiting(self.plan)
        self.eager = eager_plan(self.plan) if self.lazy else self.plan
        self.switch = switch or LazySwitch()
        self.parts = parts if self.lazy else []  # kept only to make a lazy form's copy later
        self.versions = [w._version for w in parts] if self.lazy else []
        whole = joined(parts)
        self.kept = {name: FORMS[name].prepare(whole) for name in dict.fromkeys(self.eager)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b = bucket(len(x))
        name = self.plan[b]
        if name in self.lazy and not self._runs(name):
            name = self.eager[b]
        return FORMS[name].run(self.kept[name], x, self.bias)

    def _runs(self, lazy: str) -> bool:
        """Whether lazy form `lazy` runs now; its copy made if this is its first product."""
        if not self.switch.on:
            return False
        if lazy not in self.kept:
            if [w._version for w in self.parts] != self.versions:
                if not self.switch.warned:
                    log.warning("the decoder's weights changed after its copies were made: the rows of its %s "
                                "form keep to its other forms", lazy)
                    self.switch.warned = True
                self.plan, self.lazy = self.eager, set()  # for good: every form of the numbers made at first
                return False
            self.kept[lazy] = FORMS[lazy].prepare(joined(self.parts))
        return True


class Float16:
    """The weight stored in float16 and multiplied in fp32 by fbgemm's fp16 GEMM: half the bytes
    to read per decoded token, and the weight packed once, not on every call (docs/performance.md).
    Activations and accumulation stay in fp32, so each row's result is its own, whatever else is
    in the batch; the weight's rounding (relative 2^-11) is 8× finer than bfloat16's. A bias is
    added in fp32, inside the product."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = weight.detach().float()
        if w.abs().max() > torch.finfo(torch.float16).max:
            raise ValueError("engine.dtype = 'float16': a weight exceeds float16's range (65504); use float32 or bfloat16")
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed).to(x.dtype)

    @staticmethod
    def unavailable() -> str | None:
        """Why this format cannot run here (no fbgemm), or None."""
        if torch.backends.quantized.engine not in ("fbgemm", "x86"):
            return (f"engine.dtype = 'float16' needs fbgemm's CPU kernels (torch.backends.quantized.engine "
                    f"'x86' or 'fbgemm'); this PyTorch uses {torch.backends.quantized.engine!r}")
        return None


class Int8:
    """The weight stored as int8 per output channel (symmetric: scale = max |w| / 127 for each
    row of the [out, in] weight), activations left in 16 or more bits: a quarter of fp32's bytes
    to read per decoded token, half of bfloat16's.

    Up to `KERNEL_ROWS` rows run through PyTorch's weight-only kernel (`torch._weight_int8pack_mm`,
    the int8 weight widened inside the kernel, fp32 sums), with the activations in bfloat16 (the
    kernel is vectorised for bfloat16 on AVX-512 only: fp32 activations ran 4-7× slower than the
    bf16 product there at one row, and every dtype 5-15× slower on an AVX2 CPU; docs/LOG.md).
    More rows run as `fixed_plan` runs the model's own weights (bf16: oneDNN on a packed copy;
    fp32: MKL's `(W xᵀ)ᵀ`, not the probed plan), on q held in the model's dtype (exact: |q| ≤ 127 needs 7 bits), scaled
    after, as fast at 8 rows and faster from 16: the same weight q · scale either way, so a row's
    numbers change with the size of its batch only by where results are rounded (and, for an
    fp32 model, by the kernel's bf16 activations and results). It holds both copies of q (1 + 2
    bytes a weight beside a bf16 model, 1 + 4 beside an fp32 one).

    At a few rows every weight streams from memory once a token, so reading half the bytes is
    the gain: on a Zen 4 EPYC the engine ran 1.24-1.36× bf16's own (packed) weights at one row,
    1.24-1.30× at two, and level from four (docs/performance.md, session 14; 1.45-1.67× at 1-2
    rows against the plain bf16 product before packing). There float16 (`Float16`) is as fast
    from 2 rows and adds no mismatch, where int8 adds ~0.025 nats a token to bf16's ~0.04 on the
    bundled model.
    Unlike fbgemm's W8A8 dynamic quantization (dropped: 0.49 nats of mismatch on the bundled
    model), nothing here rounds the activations to 8 bits. A bias is added to the rounded product."""

    KERNEL_ROWS = 4

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.bias = None if bias is None else bias.detach()
        w = weight.detach().float().contiguous()
        scale = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        scale = scale.bfloat16().float()  # the kernel takes bf16 scales: both paths use these
        self.q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        self.scale = scale.bfloat16()
        # q in the model's dtype (exact), multiplied as `fixed_plan` multiplies the model's own
        # weights beyond one row: fp32 `(W xᵀ)ᵀ` through MKL, bf16 on a oneDNN-packed copy
        q_model = self.q.to(weight.dtype)
        self.rest = Dense(q_model, fixed_plan(q_model, head=True))
        self.scale_model = scale.to(weight.dtype)  # exact: a bf16 value

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) <= self.KERNEL_ROWS:
            y = torch._weight_int8pack_mm(x.bfloat16().contiguous(), self.q, self.scale).to(x.dtype)
        else:
            y = self.rest(x) * self.scale_model
        return y if self.bias is None else y + self.bias

    @staticmethod
    def unavailable() -> str | None:
        """Why this format cannot run here (a CPU without AVX-512, where the kernel is slow), or None."""
        capability = torch.backends.cpu.get_cpu_capability()
        if "AVX512" not in capability:
            return (f"engine.dtype = 'int8' runs PyTorch's weight-only int8 kernel, vectorised for AVX-512 "
                    f"CPUs only; on this CPU (PyTorch's capability {capability!r}) it is several times slower "
                    f"than the model's own weights (docs/LOG.md): use the model's dtype (\"auto\", bfloat16, float32)")
        return None


Projection = Dense | Float16 | Int8
WEIGHTS: dict[str, type[Float16] | type[Int8]] = {"float16": Float16, "int8": Int8}
"""Weight formats besides "model" (the engine model's own weights, `Dense`): `engine.dtype =
"float16"` and `"int8"` (weight-only). Fbgemm's W8A8 dynamic quantization (int8 activations
too) was tried and left out: on the bundled model it moved the sampled tokens' log-probs by 0.49
nats on average (docs/LOG.md)."""


def decode_weights(dtype: str) -> str:
    """The decoder's weight format for an `engine.dtype`: its own name for a format of `WEIGHTS`
    ("float16"), "model" for a dtype the engine model itself takes."""
    return dtype if dtype in WEIGHTS else "model"


def weights_unavailable(fmt: str) -> str | None:
    """Why the weight format `fmt` cannot run here, or None when it can."""
    if fmt == "model":
        return None
    if fmt not in WEIGHTS:
        return f"the decoder's weights must be 'model' or {' or '.join(repr(k) for k in WEIGHTS)}, not {fmt!r}"
    return WEIGHTS[fmt].unavailable()


class FusedWeights:
    """The decoder's weights, from the model's current parameters, with q/k/v fused into one
    projection and the MLP's gate/up into another. ``fmt`` "model" keeps the model's numbers
    (`Dense` on the plans of `product_plans`; the output head too where it has no bias and runs
    on a CPU in fp32 or bf16, else the head is left to the model); "float16" and "int8" store
    every projection and the output head in that format (`Float16`, `Int8`)."""

    def __init__(self, model: PreTrainedModel, fmt: str = "model", *, fp16: bool = True,
                 plans: Plans | None = None) -> None:
        """``fp16`` False: the plans without float16 forms (`without_fp16`); ``plans``: these plans
        instead of `product_plans`' (matched numerics' own, rlvr.rollout.matched)."""
        self.model, self.fmt = model, fmt
        self.switch = LazySwitch(on=False)  # the lazy forms wait for the decoder (`LAZY_AFTER`)
        make: Callable[..., Projection]  # (parts, bias=None)
        if fmt == "model":
            plans = plans or product_plans(model)
            if not fp16:
                plans = Plans(without_fp16(plans.layers), without_fp16(plans.head))
            self.plans: Plans | None = plans
            make = functools.partial(Dense, plan=plans.layers, switch=self.switch)
        else:
            self.plans = None

            def make(parts: list[torch.Tensor], bias: torch.Tensor | None = None) -> Projection:
                return WEIGHTS[fmt](joined(parts), bias)
        # each plan's forms that wait for the switch (`waiting`); whether some rows can run a product
        # in float16 (`Form.in_fp16`: the decoder then checks those steps for an overflow), and
        # whether every such form waits for the switch
        self._waiting = {plan: waiting(plan) for plan in self.plans or ()}
        self.has_lazy = any(self._waiting.values())
        self.in_fp16 = any(FORMS[name].in_fp16 for plan in self._waiting for name in plan)
        self.fp16_waits = all(name in waits for plan, waits in self._waiting.items()
                              for name in plan if FORMS[name].in_fp16)
        self.qkv: list[Projection] = []  # with the q/k/v biases, where the model has them (Qwen2)
        self.o: list[Projection] = []
        self.gate_up: list[Projection] = []
        self.down: list[Projection] = []
        for layer in model.model.layers:
            qkv, o, gate_up, down = fused_parts(layer)
            self.qkv.append(make(qkv, bias=fused_bias(layer)))
            self.o.append(make(o))
            self.gate_up.append(make(gate_up))
            self.down.append(make(down))
        head = model.lm_head.weight
        if fmt != "model":
            self.head: Projection | None = make([head])
        elif model.lm_head.bias is None and head.device.type == "cpu" and head.dtype in PROBED_DTYPES:
            assert self.plans is not None
            self.head = Dense(head, self.plans.head, switch=self.switch)
        else:  # the model's own head
            self.head = None

    def _forms_at(self, layer_rows: int, head_rows: int) -> list[tuple[str, bool]]:
        """Each plan's form for its row count in a step, and whether that form waits for the switch."""
        if self.plans is None:
            return []
        pairs = [(self.plans.layers, layer_rows)] + ([(self.plans.head, head_rows)] if isinstance(self.head, Dense) else [])
        return [(plan[bucket(rows)], plan[bucket(rows)] in self._waiting[plan]) for plan, rows in pairs]

    def lazy_at(self, layer_rows: int, head_rows: int) -> bool:
        """Whether a step of these row counts (the layers', the head's) has a form that waits for the
        switch (`LAZY_AFTER`)."""
        return self.has_lazy and any(waits for _, waits in self._forms_at(layer_rows, head_rows))

    def fp16_at(self, layer_rows: int, head_rows: int) -> bool:
        """Whether a step of these row counts runs a product in float16 now (`Form.in_fp16`; a form
        that waits only while the switch is on)."""
        return self.in_fp16 and any(FORMS[name].in_fp16 and (self.switch.on or not waits)
                                    for name, waits in self._forms_at(layer_rows, head_rows))

    def without_fp16(self) -> FusedWeights:
        """These weights without float16 forms: for the rest of a decode call where a step
        overflowed float16's range and its float16 forms do not all wait for the switch (the
        engine's own weights stay as they are, so later calls do not depend on this one)."""
        return FusedWeights(self.model, self.fmt, fp16=False, plans=self.plans)
