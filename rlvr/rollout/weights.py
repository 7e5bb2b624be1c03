"""The static decoder's weights: the forms its matrix products take, and the formats it can hold
them in.

`FusedWeights` takes a model's current parameters, with the query, key and value projections
fused into one matrix and the MLP's gate and up projections into another. Each projection is a
`Dense` on the model's own numbers, or, with `engine.dtype` "float16" or "int8", a `Float16` or
`Int8` copy.

**Which product runs depends on the CPU, so on a CPU it is measured, not assumed.** The same
fp32 product has several forms in PyTorch (`FORMS`): `x @ W` on an [in, out] copy, `(W xᵀ)ᵀ` or
`nn.Linear` on the model's own [out, in] weight, MKL's or oneDNN's product on a weight packed
once. Which is fastest depends on the CPU, its BLAS, the row count and the shape, by up to
2.1× a decode step (bench/small_gemm.py --stack, fp32, 2 threads):
- on a Zen 3 EPYC, `(W xᵀ)ᵀ` ran 2-16 rows 1.4-3.2× faster than `x @ W`;
- on an Intel Xeon (family 6 model 207), the same `(W xᵀ)ᵀ` ran 2-8 rows 1.2-1.7× *slower*
  than `x @ W`, and 1.8-2.1× slower than MKL's packed product;
- on a Zen 4 EPYC, oneDNN's packed product was fastest at 1 and 4-64 rows, `(W xᵀ)ᵀ` at 2.
So on a CPU `Dense` runs on a plan (`Plan`: a form for each row bucket of `ROWS`) that
`product_plans` measures on the model's own weights once per CPU, torch version, dtype and model
shape (~3 s for the bundled model, kept in $RLVR_CACHE/products.json), within a memory budget of
one or two copies of each weight beside the model's own (`copy_budget`), the output head's
included (docs/LOG.md, sessions 15 and 16).

bf16 has the same forms and one more, "half": a float16 copy, exact for bf16 weights, that one
row multiplies 1.45× faster than oneDNN's packed bf16 on a Zen 4 EPYC, where oneDNN is the
fastest from two rows (1.3-2.3× `x @ W` a decode step there and on an Intel Xeon with AMX).
With `RLVR_PRODUCTS=fixed`, bf16 runs oneDNN-packed copies at every row count. Elsewhere (GPUs)
`x @ W` runs on an [in, out] copy.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from rlvr.models import cpu_signature, machine_memory, measured, remember

log = logging.getLogger(__name__)


class Form(NamedTuple):
    """One way to compute x Wᵀ from the [out, in] weight W: what it keeps of W (``prepare``), the
    product on what it kept (``run``), and whether what it keeps is a copy of W (counted against
    the memory budget) or W itself. ``dtypes``: the weight dtypes it gives the model's own
    product for (None: every dtype). ``in_fp16``: it computes in float16, where a value beyond
    float16's range (65504) becomes inf; the decoder checks such steps and runs one that
    overflowed again, and the rest of its call, without such forms (`StaticDecoder.step`).
    ``lazy``: it runs only while the `Dense`'s switch is on (`LAZY_AFTER`), its copy made on the
    first product that runs it."""

    prepare: Callable[[torch.Tensor], Any]
    run: Callable[[Any, torch.Tensor], torch.Tensor]
    copies: bool
    dtypes: frozenset[torch.dtype] | None = None
    in_fp16: bool = False
    lazy: bool = False


PACK_ROWS = 8
"""The row count oneDNN and MKL lay a packed weight out for (any count runs on it)."""


def _mkl_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS), w


def _mkl_run(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    packed, w = state
    return torch.ops.mkl._mkl_linear(x.contiguous(), packed, w, None, len(x))


def _half(w: torch.Tensor) -> torch.Tensor:
    h = w.half()
    return h if bool(torch.isfinite(h).all()) else w  # beyond float16's range: the weight itself


def _half_run(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(h.dtype), h).to(x.dtype)


FORMS: dict[str, Form] = {
    "linear": Form(lambda w: w, lambda w, x: torch.nn.functional.linear(x, w), copies=False),
    "left": Form(lambda w: w, lambda w, x: (w @ x.T).T.contiguous(), copies=False),
    "xw": Form(lambda w: w.T.contiguous(), lambda w, x: x @ w, copies=True),
    "mkl": Form(_mkl_pack, _mkl_run, copies=True),  # MKL's packed sgemm (fp32), what inductor emits
    "onednn": Form(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
                   lambda p, x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, None, "none", [], ""),
                   copies=True),
    "half": Form(_half, _half_run, copies=True, dtypes=frozenset({torch.bfloat16}), in_fp16=True, lazy=True),
}
"""The forms of one product. "linear": `nn.Linear`'s `x Wᵀ`; "left": `(W xᵀ)ᵀ`; "xw": `x @ W` on a
contiguous [in, out] copy; "mkl" and "onednn": the weight reordered once into the library's
blocked layout (`torch.ops.mkl._mkl_reorder_linear_weight`, `torch.ops.mkldnn.
_reorder_linear_weight`) and multiplied by its linear op. All sum in the weight's dtype's
accumulator (fp32 for fp32 and bf16), each in its own order.

"half" (bf16 weights only): `nn.Linear` on a float16 copy of the weight, with the activations
in float16 too. PyTorch's float16 matrix-vector kernel sums in fp32, and on a Zen 4 EPYC it ran
a one-row decode step's products in 9.0 ms where oneDNN's packed bf16 took 13.1 (docs/LOG.md,
session 16; `bench/small_gemm.py --dtype bfloat16 --stack`); the copy costs a cast, not a repacking (0.1 s for the bundled model).
A bf16 number from 2^-17 (7.6e-6) to 65280 is exactly a float16 number (8 significant bits in
11; below 2^-14 float16's subnormal steps of 2^-24 still hold them), so the product is the bf16
product summed in another order, with the result rounded to float16 (2^-11 of it) before bf16
(2^-8). A smaller weight, activation or result is rounded to a multiple of 2^-24, by at most
2^-25 (3e-8): under bf16's own rounding of any term or sum above 2^-16. A weight beyond 65504
keeps the bf16 weight; an activation beyond it overflows, which the decoder catches
(`Form.in_fp16`)."""

ROWS = (1, 2, 4, 8, 16, 32, 64)
"""The row buckets of a `Plan`: rows r run in the form of the smallest bucket ≥ r (64 for more)."""

Plan = tuple[str, ...]
"""A form name (`FORMS`) for each bucket of `ROWS`."""


def bucket(rows: int) -> int:
    """The index in `ROWS` whose form runs `rows` rows."""
    return min((rows - 1).bit_length(), len(ROWS) - 1)


LAZY_AFTER = 64
"""The one-row steps a decode call runs before its lazy forms (`Form.lazy`) take over, unless it
starts with one row and asks for at least this many tokens (`StaticDecoder`). Making the bundled
model's float16 copies takes about what 64 one-row decode steps save with them (~0.27 s against
~4 ms a step, bf16 on a Zen 4 EPYC; docs/LOG.md, session 16): so a GRPO step whose last sample
decodes alone for a few steps makes no copy it would barely use, and serving or evaluating one
row at a time uses the copy throughout. Counted per call, so a call's numbers depend only on
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
    other numbers, so those rows keep to the other form."""

    def __init__(self, weight: torch.Tensor | Sequence[torch.Tensor], plan: Plan | None = None,
                 switch: LazySwitch | None = None) -> None:
        parts = [weight.detach()] if isinstance(weight, torch.Tensor) else [w.detach() for w in weight]
        self.plan = plan or fixed_plan(parts[0])
        self.lazy = waiting(self.plan)
        self.eager = eager_plan(self.plan) if self.lazy else self.plan
        self.switch = switch or LazySwitch()
        self.parts = parts if self.lazy else []  # kept only to make a lazy form's copy later
        self.versions = [w._version for w in parts] if self.lazy else []
        joined = _joined(parts)
        self.kept = {name: FORMS[name].prepare(joined) for name in dict.fromkeys(self.eager)}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        b = bucket(len(x))
        name = self.plan[b]
        if name in self.lazy and not self._runs(name):
            name = self.eager[b]
        return FORMS[name].run(self.kept[name], x)

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
            self.kept[lazy] = FORMS[lazy].prepare(_joined(self.parts))
        return True


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """The weight whose rows `parts` are (q, k, v; gate, up), joined; a single weight as it is."""
    return parts[0].contiguous() if len(parts) == 1 else torch.cat(parts)


def waiting(plan: Plan) -> set[str]:
    """The lazy forms of `plan` (`Form.lazy`) that wait for their switch: none where every form of
    the plan is lazy (nothing else to run meanwhile: they are made at once)."""
    lazy = {name for name in plan if FORMS[name].lazy}
    return lazy if len(lazy) < len(set(plan)) else set()


def eager_plan(plan: Plan) -> Plan:
    """`plan` with each lazy form (`Form.lazy`) replaced by the nearest bucket's form that is not
    (`replaced`)."""
    return replaced(plan, lambda form: form.lazy)


def fixed_plan(weight: torch.Tensor, *, head: bool = False) -> Plan:
    """The plan without a probe. bf16 on a CPU where oneDNN packs it: "onednn" (of the bf16
    forms that copy no weight in another dtype, the fastest at 1-64 rows on both bf16 CPUs
    measured). fp32 on a CPU with MKL: "xw" at one row ("linear" for
    the output head, whose [in, out] copy would be the size of the embedding matrix) and "left"
    beyond (the fastest on the Zen 3 it was tuned on; `product_plans` measures it instead). Else
    "xw" (GPUs, or "linear" for the head where nothing else is known)."""
    n = len(ROWS)
    if packed_form(weight):
        return ("onednn",) * n
    if weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkl.is_available():
        return ("linear" if head else "xw",) + ("left",) * (n - 1)
    return ("linear" if head else "xw",) * n


def packed_form(weight: torch.Tensor) -> bool:
    """Whether `fixed_plan` runs `weight` on oneDNN-packed copies: bf16 on a CPU where oneDNN packs
    bf16 (`bf16_packing_unavailable`)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and bf16_packing_unavailable() is None


@functools.cache
def bf16_packing_unavailable() -> str | None:
    """Why oneDNN cannot pack a bf16 weight here, or None: a PyTorch without oneDNN's linear, or a
    CPU it has no bf16 path for (it asks for AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2-only CPU
    such as a Zen 3 has neither). Probed once on a small weight and logged, so a bench that runs
    the plain bf16 product says why."""
    why = form_unavailable("onednn", torch.bfloat16)
    if why is not None and torch.backends.mkldnn.is_available():
        why = f"oneDNN's packed bf16 linear is unavailable here ({why})"
    if why is not None:
        log.info("bf16 decoding runs the plain product: %s", why)
    return why


def form_unavailable(name: str, dtype: torch.dtype) -> str | None:
    """Why the form `name` cannot run a small weight of `dtype` here (a PyTorch built without MKL
    or oneDNN, a CPU the library has no kernel for), or gives it a wrong product (beyond bf16's
    rounding, 2^-7 of Σ|x·w|, at 1, 3, 8 and 17 rows; or one that sums in fewer bits than fp32:
    2048 plus a thousand ones, which a float16 or bf16 sum leaves at 2048), or None."""
    dtypes = FORMS[name].dtypes
    if dtypes is not None and dtype not in dtypes:
        return f"the {name} form keeps a copy exact only for {' and '.join(map(str, sorted(dtypes, key=str)))} weights, not {dtype}"
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if name == "mkl" and not torch.backends.mkl.is_available():
        return "this PyTorch has no MKL"
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(24, 16, generator=gen).to(dtype)
    ones = torch.ones(24, 1001, dtype=dtype)
    try:
        kept, kept_ones = FORMS[name].prepare(w), FORMS[name].prepare(ones)
        for rows in (1, 3, PACK_ROWS, 17):  # one row, a few, the packed count, more
            for k, weight, x in ((kept, w, torch.randn(rows, 16, generator=gen).to(dtype)),
                                 (kept_ones, ones, torch.ones(rows, 1001, dtype=dtype).index_fill_(1, torch.tensor([0]), 2048))):
                y = FORMS[name].run(k, x).double()
                exact = x.double() @ weight.double().T
                if not ((y - exact).abs() <= 2**-7 * (x.double().abs() @ weight.double().abs().T)).all():
                    return f"{name} gives a wrong product at {rows} rows here"
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        return (str(e).splitlines() or [type(e).__name__])[0][:160]
    return None


class Plans(NamedTuple):
    """The plans of a model's layer projections and of its output head."""

    layers: Plan
    head: Plan


PROBE_BYTES = 64 << 20
"""The layers' weights a probe times together: at least this many bytes (or all layers), more than
a CPU's last-level cache share, so each product streams its weight from memory as in decoding."""


PROBED_DTYPES = (torch.float32, torch.bfloat16)
"""The weight dtypes whose plans a CPU measures (`product_plans`)."""


def product_plans(model: PreTrainedModel) -> Plans:
    """The plans `FusedWeights` runs a model's projections on. fp32 or bf16 on a CPU: measured by
    `probe_plan` on the model's own weights once for each CPU, torch version, dtype, set of
    shapes and copy budget (`copy_budget`), and kept in $RLVR_CACHE/products.json, so every later
    process on this machine (a resumed run, a rollout worker) runs the same forms and gets the
    same numbers; RLVR_PRODUCTS=fixed in the environment takes `fixed_plan` instead, without
    measuring. Otherwise `fixed_plan`."""
    head = model.lm_head.weight
    choice = os.environ.get("RLVR_PRODUCTS", "probe")
    if choice not in ("probe", "fixed"):
        raise ValueError(f"RLVR_PRODUCTS must be 'probe' (the default) or 'fixed', not {choice!r}")
    fixed = Plans(fixed_plan(head), fixed_plan(head, head=True))
    if choice == "fixed" or any(p.device.type != "cpu" or p.dtype != head.dtype for p in model.parameters()) \
            or head.dtype not in PROBED_DTYPES:
        return fixed
    shapes = ",".join("x".join(map(str, p.shape)) for p in model.model.layers[0].parameters())
    copies = copy_budget(model)
    key = (f"{cpu_signature()}|torch {torch.__version__}|{head.dtype}|layers {shapes} x{len(model.model.layers)}"
           f"|head {'x'.join(map(str, head.shape))}|copies {copies}")
    if key not in _PROBED:
        _PROBED[key] = _known_plans(key) or _probe(key, model, copies)
    return _PROBED[key]


def copy_budget(model: PreTrainedModel) -> int:
    """How many forms that copy the weights (`Form.copies`) a plan may keep beside the model's
    own: two where two copies of the decoder's weights take at most 1/16 of this machine's
    memory (`machine_memory`; the bundled model's 0.54 GB in bf16 beside a laptop's 16 GB), else
    one, as `x @ W`'s [in, out] copy always cost."""
    size = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    size += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    memory = machine_memory()
    return 2 if memory is not None and 2 * size * 16 <= memory else 1


_PROBED: dict[str, Plans] = {}
"""`product_plans`' plans in this process, by CPU, torch version, dtype, shapes and copy budget."""


def _known_plans(key: str) -> Plans | None:
    """The plans kept in $RLVR_CACHE/products.json for `key`, or None."""
    try:
        known = measured("products.json", key)
        plans = Plans(tuple(known["layers"]), tuple(known["head"]))
    except (KeyError, TypeError):
        return None
    ok = all(len(plan) == len(ROWS) and set(plan) <= set(FORMS) for plan in plans)
    return plans if ok else None


def _probe(key: str, model: PreTrainedModel, copies: int) -> Plans:
    """Measure the plans (`probe_plan`): the first layers' fused weights up to `PROBE_BYTES`, and
    the head's first rows up to `PROBE_BYTES` (its products behave as the whole head's, and the
    probe's time and extra memory stay bounded for a large vocabulary; not where the head has a
    bias, which the decoder leaves to the model); kept in $RLVR_CACHE/products.json."""
    start = time.perf_counter()
    dtype = str(model.lm_head.weight.dtype).removeprefix("torch.")
    log.info("timing the %s decode products' forms on the model's weights (once per CPU and model shape)", dtype)
    layers, size = [], 0
    for layer in model.model.layers:
        if size >= PROBE_BYTES:
            break
        layers.append(layer)
        size += sum(p.numel() * p.element_size() for p in layer.parameters())
    head = model.lm_head.weight.detach()
    head_rows = max(1, PROBE_BYTES // (head.shape[1] * head.element_size()))
    plans = Plans(probe_plan([w for layer in layers for w in fused(layer)], copies=copies),
                  probe_plan([head[:head_rows]], copies=copies) if model.lm_head.bias is None
                  else fixed_plan(head, head=True))
    log.info("%s decode products chosen in %.1f s (rows %s): layers %s, head %s", dtype, time.perf_counter() - start,
             "/".join(map(str, ROWS)), "/".join(plans.layers), "/".join(plans.head))
    remember("products.json", key, {"layers": list(plans.layers), "head": list(plans.head)})
    return plans


def fused(layer: Any) -> tuple[torch.Tensor, ...]:
    """A Llama-family decoder layer's [out, in] weights in the order a step multiplies them: q/k/v
    fused, the attention output, the MLP's gate/up fused, its down projection."""
    return tuple(_joined(parts) for parts in fused_parts(layer))


def fused_parts(layer: Any) -> tuple[list[torch.Tensor], ...]:
    """`fused`'s weights as the model's own parameters (detached, not copied), each a list of the
    weights whose rows it joins."""
    attn, mlp = layer.self_attn, layer.mlp
    return ([attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()],
            [attn.o_proj.weight.detach()],
            [mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()],
            [mlp.down_proj.weight.detach()])


def probe_plan(weights: Sequence[torch.Tensor], reps: int = 2, copies: int = 1) -> Plan:
    """The plan `choose_plan` picks from timing each available form (`FORMS`) on ``weights`` ([out,
    in], multiplied in turn as a step does) at each row bucket: the fastest of ``reps`` passes
    after one warm-up pass (the libraries make their kernels on a first call). One form at a time,
    so at most one copy of the weights exists beside them. ``copies``: `choose_plan`'s budget."""
    dtype = weights[0].dtype
    times: dict[str, list[float]] = {}
    for name in FORMS:
        if form_unavailable(name, dtype) is not None:
            continue
        form = FORMS[name]
        kept = [form.prepare(w) for w in weights]
        times[name] = []
        gen = torch.Generator().manual_seed(0)  # not the global generator: a run's random draws stay its own
        for rows in ROWS:
            xs = [torch.randn(rows, w.shape[1], generator=gen).to(dtype) for w in weights]
            best = math.inf
            for rep in range(reps + 1):
                start = time.perf_counter()
                for k, x in zip(kept, xs):
                    form.run(k, x)
                if rep:
                    best = min(best, time.perf_counter() - start)
            times[name].append(best)
        del kept
    return choose_plan(times, copies)


COPY_WORTH = 0.1
"""What a copy of the weights must save to be kept: a tenth of one bucket's time, summed over the
buckets (`choose_plan`)."""


def choose_plan(times: Mapping[str, Sequence[float]], copies: int = 1) -> Plan:
    """The plan from each form's time at each bucket of `ROWS`: at each bucket the fastest form, among
    the forms that keep the model's weight itself and at most ``copies`` that keep a copy (the
    memory budget, `copy_budget`). The copies kept are those whose plan has the least summed
    slowdown against each bucket's fastest form, each copy counting `COPY_WORTH` more: a copy
    that saves less than that is not kept."""
    free = [name for name in times if not FORMS[name].copies]
    copying = [name for name in times if FORMS[name].copies]
    options = [free + list(kept) for k in range(copies + 1) for kept in itertools.combinations(copying, k)]
    options = [names for names in options if names]
    fastest = [min(t[i] for t in times.values()) for i in range(len(ROWS))]

    def cost(names: list[str]) -> float:
        slowdown = sum(min(times[n][i] for n in names) / fastest[i] for i in range(len(ROWS)))
        return slowdown + COPY_WORTH * sum(FORMS[n].copies for n in names)

    names = min(options, key=cost)
    return tuple(min(names, key=lambda n: times[n][i]) for i in range(len(ROWS)))


class Float16:
    """The weight stored in float16 and multiplied in fp32 by fbgemm's fp16 GEMM: half the bytes
    to read per decoded token, and the weight packed once, not on every call (docs/performance.md).
    Activations and accumulation stay in fp32, so each row's result is its own, whatever else is
    in the batch; the weight's rounding (relative 2^-11) is 8× finer than bfloat16's."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        if w.abs().max() > torch.finfo(torch.float16).max:
            raise ValueError("engine.dtype = 'float16': a weight exceeds float16's range (65504); use float32 or bfloat16")
        self.packed = torch.ops.quantized.linear_prepack_fp16(w.contiguous(), None)

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
    model), nothing here rounds the activations to 8 bits."""

    KERNEL_ROWS = 4

    def __init__(self, weight: torch.Tensor) -> None:
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
            return torch._weight_int8pack_mm(x.bfloat16().contiguous(), self.q, self.scale).to(x.dtype)
        return self.rest(x) * self.scale_model

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


def replaced(plan: Plan, unwanted: Callable[[Form], bool]) -> Plan:
    """`plan` with each form that is `unwanted` replaced by the form of the nearest larger bucket
    that is not (of the nearest smaller where none is; "linear" where no bucket's is)."""
    ok = [i for i, name in enumerate(plan) if not unwanted(FORMS[name])]
    if not ok:
        return ("linear",) * len(plan)
    return tuple(name if i in ok else plan[min(ok, key=lambda j: (j < i, abs(j - i)))] for i, name in enumerate(plan))


def without_fp16(plan: Plan) -> Plan:
    """`plan` without the forms that compute in float16 (`Form.in_fp16`; `replaced`)."""
    return replaced(plan, lambda form: form.in_fp16)


class FusedWeights:
    """The decoder's weights, from the model's current parameters, with q/k/v fused into one
    projection and the MLP's gate/up into another. ``fmt`` "model" keeps the model's numbers
    (`Dense` on the plans of `product_plans`; the output head too where it has no bias and runs
    on a CPU in fp32 or bf16, else the head is left to the model); "float16" and "int8" store
    every projection and the output head in that format (`Float16`, `Int8`)."""

    def __init__(self, model: PreTrainedModel, fmt: str = "model", *, fp16: bool = True) -> None:
        """``fp16`` False: the plans without float16 forms (`without_fp16`)."""
        self.model, self.fmt = model, fmt
        self.switch = LazySwitch(on=False)  # the lazy forms wait for the decoder (`LAZY_AFTER`)
        make: Callable[[list[torch.Tensor]], Projection]
        if fmt == "model":
            plans = product_plans(model)
            if not fp16:
                plans = Plans(without_fp16(plans.layers), without_fp16(plans.head))
            self.plans: Plans | None = plans
            make = functools.partial(Dense, plan=plans.layers, switch=self.switch)
        else:
            self.plans = None

            def make(parts: list[torch.Tensor]) -> Projection:
                return WEIGHTS[fmt](_joined(parts))
        # each plan's forms that wait for the switch (`waiting`); whether some rows can run a product
        # in float16 (`Form.in_fp16`: the decoder then checks those steps for an overflow), and
        # whether every such form waits for the switch
        self._waiting = {plan: waiting(plan) for plan in self.plans or ()}
        self.has_lazy = any(self._waiting.values())
        self.in_fp16 = any(FORMS[name].in_fp16 for plan in self._waiting for name in plan)
        self.fp16_waits = all(name in waits for plan, waits in self._waiting.items()
                              for name in plan if FORMS[name].in_fp16)
        self.qkv: list[Projection] = []
        self.qkv_bias: list[torch.Tensor | None] = []
        self.o: list[Projection] = []
        self.gate_up: list[Projection] = []
        self.down: list[Projection] = []
        for layer in model.model.layers:
            qkv, o, gate_up, down = fused_parts(layer)
            self.qkv.append(make(qkv))
            self.o.append(make(o))
            self.gate_up.append(make(gate_up))
            self.down.append(make(down))
            attn = layer.self_attn
            biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
            self.qkv_bias.append(torch.cat(biases) if all(b is not None for b in biases) else None)
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
        return FusedWeights(self.model, self.fmt, fp16=False)
