"""Which form (rlvr.rollout.forms) runs each of the decoder's products on this CPU: measured, not
assumed.

Which form is fastest depends on the CPU, its BLAS, the row count and the shape, by up to 2.1× a
decode step (bench/small_gemm.py --stack, fp32, 2 threads):
- on a Zen 3 EPYC, `(W xᵀ)ᵀ` ran 2-16 rows 1.4-3.2× faster than `x @ W`;
- on an Intel Xeon (family 6 model 207), the same `(W xᵀ)ᵀ` ran 2-8 rows 1.2-1.7× *slower*
  than `x @ W`, and 1.8-2.1× slower than MKL's packed product;
- on a Zen 4 EPYC, oneDNN's packed product was fastest at 1 and 4-64 rows, `(W xᵀ)ᵀ` at 2.
So on a CPU the decoder runs on plans (`Plans`: a form for each row bucket, for the layers and
for the output head) that `product_plans` measures on the model's own weights once per CPU,
torch version, dtype and model shape (~3 s for the bundled model, kept in
$RLVR_CACHE/products.json), within a memory budget of one or two copies of each weight beside the
model's own (`copy_budget`), the output head's included (docs/LOG.md, sessions 15 and 16).

bf16 has the same forms and one more, "half": a float16 copy, exact for bf16 weights, that one
row multiplies 1.45× faster than oneDNN's packed bf16 on a Zen 4 EPYC, where oneDNN is the
fastest from two rows (1.3-2.3× `x @ W` a decode step there and on an Intel Xeon with AMX).
With `RLVR_PRODUCTS=fixed`, bf16 runs oneDNN-packed copies at every row count (`fixed_plan`).
Elsewhere (GPUs) `x @ W` runs on an [in, out] copy.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from transformers import PreTrainedModel

from rlvr.models import cpu_signature, machine_memory, measured, remember
from rlvr.rollout.forms import FORMS, ROWS, Plan, form_unavailable, fused

log = logging.getLogger(__name__)


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
    """The plans rlvr.rollout.weights' `FusedWeights` runs a model's projections on. fp32 or bf16 on
    a CPU: measured by `probe_plan` on the model's own weights once for each CPU, torch version,
    dtype, set of shapes and copy budget (`copy_budget`), and kept in $RLVR_CACHE/products.json, so
    every later process on this machine (a resumed run, a rollout worker) runs the same forms and
    gets the same numbers; RLVR_PRODUCTS=fixed in the environment takes `fixed_plan` instead,
    without measuring. Otherwise `fixed_plan`. A process that follows another's plans
    (`follow_plans`: a resumed run its first invocation's, rlvr.rollout.numerics) takes those
    for the shapes they name, whatever this machine's cache holds now. The plans each shape got
    are kept (`used_plans`)."""
    head = model.lm_head.weight
    choice = os.environ.get("RLVR_PRODUCTS", "probe")
    if choice not in ("probe", "fixed"):
        raise ValueError(f"RLVR_PRODUCTS must be 'probe' (the default) or 'fixed', not {choice!r}")
    fixed = Plans(fixed_plan(head), fixed_plan(head, head=True))
    if any(p.device.type != "cpu" or p.dtype != head.dtype for p in model.parameters()) \
            or head.dtype not in PROBED_DTYPES:
        return fixed
    layer_shapes = ",".join("x".join(map(str, p.shape)) for p in model.model.layers[0].parameters())
    shape = f"{head.dtype}|layers {layer_shapes} x{len(model.model.layers)}|head {'x'.join(map(str, head.shape))}"
    if shape in _FOLLOWED:
        return _FOLLOWED[shape]
    if choice == "fixed":
        plans = fixed
    else:
        copies = copy_budget(model)
        key = f"{cpu_signature()}|torch {torch.__version__}|{shape}|copies {copies}"
        if key not in _PROBED:
            _PROBED[key] = _known_plans(key) or _probe(key, model, copies)
        plans = _PROBED[key]
    _USED[shape] = plans
    return plans


def used_plans() -> dict[str, Plans]:
    """The plans `product_plans` gave in this process, by dtype and shapes."""
    return dict(_USED)


def follow_plans(plans: Mapping[str, Plans]) -> None:
    """Give these plans (another process's `used_plans`) for the dtypes and shapes they name, from
    now on, instead of this machine's measurement; they replace any followed before ({}: this
    process's own again). A plan naming a form this machine lacks is the caller's to refuse."""
    _FOLLOWED.clear()
    _FOLLOWED.update(plans)


def copy_budget(model: PreTrainedModel) -> int:
    """How many forms that copy the weights (`Form.copies`, rlvr.rollout.forms) a plan may keep
    beside the model's own: two where two copies of the decoder's weights take at most 1/16 of this machine's
    memory (`machine_memory`; the bundled model's 0.54 GB in bf16 beside a laptop's 16 GB), else
    one, as `x @ W`'s [in, out] copy always cost."""
    size = sum(p.numel() * p.element_size() for p in model.model.layers.parameters())
    size += model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    memory = machine_memory()
    return 2 if memory is not None and 2 * size * 16 <= memory else 1


_PROBED: dict[str, Plans] = {}
"""`product_plans`' plans in this process, by CPU, torch version, dtype, shapes and copy budget."""
_USED: dict[str, Plans] = {}
"""The plans `product_plans` gave, by dtype and shapes (`used_plans`)."""
_FOLLOWED: dict[str, Plans] = {}
"""Another process's plans this one follows, by dtype and shapes (`follow_plans`)."""


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


def probe_plan(weights: Sequence[torch.Tensor], reps: int = 2, copies: int = 1) -> Plan:
    """The plan `choose_plan` picks from timing each available form (`FORMS`) on ``weights`` ([out,
    in], multiplied in turn as a step does) at each row bucket: the fastest of ``reps`` passes
    after one warm-up pass (the libraries make their kernels on a first call). One form at a time,
    so at most one copy of the weights exists beside them. ``copies``: `choose_plan`'s budget."""
    dtype = weights[0].dtype
    times: dict[str, list[float]] = {}
    for name in FORMS:
        if FORMS[name].paired or form_unavailable(name, dtype) is not None:
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
                    form.run(k, x, None)
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
