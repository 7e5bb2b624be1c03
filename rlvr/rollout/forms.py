"""The forms one of the decoder's matrix products can take, and the products a decode step runs.

The same product x Wᵀ has several forms in PyTorch (`FORMS`): `x @ W` on an [in, out] copy,
`(W xᵀ)ᵀ` or `nn.Linear` on the model's own [out, in] weight, MKL's or oneDNN's product on a
weight packed once, and for bf16 weights `nn.Linear` on a float16 copy ("half"). Each is the
same product summed in another order; which is fastest depends on the CPU, the row count and
the shape (rlvr.rollout.plans measures it). A `Plan` names a form for each row bucket of
`ROWS`; `form_unavailable` says why a form cannot run here, or gives a wrong product.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch


class Form(NamedTuple):
    """One way to compute x Wᵀ + b from the [out, in] weight W: what it keeps of W (``prepare``), the
    product on what it kept, with a bias b or None (``run``), and whether what it keeps is a copy of
    W (counted against the memory budget) or W itself. Every form but "left" adds the bias inside
    its kernel, to the float32 sums, and rounds once, as `nn.Linear` does; "left" adds it to the
    rounded product (in bf16, 30% of a Qwen2 projection's outputs then differ from nn.Linear's
    in the last bit; docs/LOG.md, session 39). ``dtypes``: the weight dtypes it gives the model's own
    product for (None: every dtype). ``in_fp16``: it computes in float16, where a value beyond
    float16's range (65504) becomes inf; the decoder checks such steps and runs one that
    overflowed again, and the rest of its call, without such forms (`StaticDecoder.step` in
    rlvr.rollout.static_decode). ``lazy``: it runs only while its `Dense`'s switch is on
    (rlvr.rollout.weights: `LAZY_AFTER`), its copy made on the first product that runs it.
    ``paired``: another form's product with a single row run as two (`_paired`), for matched
    numerics only (rlvr.rollout.matched); the speed probe does not time it."""

    prepare: Callable[[torch.Tensor], Any]
    run: Callable[[Any, torch.Tensor, torch.Tensor | None], torch.Tensor]
    copies: bool
    dtypes: frozenset[torch.dtype] | None = None
    in_fp16: bool = False
    lazy: bool = False
    paired: bool = False


PACK_ROWS = 8
"""The row count oneDNN and MKL lay a packed weight out for (any count runs on it)."""


def _mkl_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.mkl._mkl_reorder_linear_weight(w, PACK_ROWS), w


def _mkl_run(state: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    packed, w = state
    return torch.ops.mkl._mkl_linear(x.contiguous(), packed, w, b, len(x))


def _half(w: torch.Tensor) -> torch.Tensor:
    # within float16's range, the copy; beyond it (or NaN, where both comparisons fail), the weight
    # itself. One pass of `aminmax` over the weight: 9 ms for the bundled model, where checking the
    # copy with `isfinite(...).all()` took 175 ms, three times the cast (docs/LOG.md, session 17)
    # compared as Python floats: in bf16, 65504 itself would round to 65536
    if not w.numel():
        return w.half()
    low, high = (float(m) for m in torch.aminmax(w))
    limit = torch.finfo(torch.float16).max
    return w.half() if -limit <= low and high <= limit else w


def _half_run(h: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(h.dtype), h, None if b is None else b.to(h.dtype)).to(x.dtype)


def _left_run(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    y = (w @ x.T).T.contiguous()
    return y if b is None else y + b


def _xw_run(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w if b is None else torch.addmm(b, x, w)


FORMS: dict[str, Form] = {
    "linear": Form(lambda w: w, lambda w, x, b: torch.nn.functional.linear(x, w, b), copies=False),
    "left": Form(lambda w: w, _left_run, copies=False),
    "xw": Form(lambda w: w.T.contiguous(), _xw_run, copies=True),
    "mkl": Form(_mkl_pack, _mkl_run, copies=True),  # MKL's packed sgemm (fp32), what inductor emits
    "onednn": Form(lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS),
                   lambda p, x, b: torch.ops.mkldnn._linear_pointwise(x.contiguous(), p, b, "none", [], ""),
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
session 16; `bench/small_gemm.py --dtype bfloat16 --stack`); the copy costs a cast, not a repacking (47 ms for the bundled model, and 9 ms to check its range).
A bf16 number from 2^-17 (7.6e-6) to 65280 is exactly a float16 number (8 significant bits in
11; below 2^-14 float16's subnormal steps of 2^-24 still hold them), so the product is the bf16
product summed in another order, with the result rounded to float16 (2^-11 of it) before bf16
(2^-8). A smaller weight, activation or result is rounded to a multiple of 2^-24, by at most
2^-25 (3e-8): under bf16's own rounding of any term or sum above 2^-16. A weight beyond 65504
keeps the bf16 weight; an activation beyond it overflows, which the decoder catches
(`Form.in_fp16`).

"onednn_paired" and "linear_paired": those forms with a single row run as two (`_paired`),
for matched numerics only."""


def _paired(form: Form) -> Form:
    """`form` with a one-row product run on the row twice, the first result kept: where a CPU's
    kernel for one row sums in another order than for two or more (oneDNN's bf16 1536→576 product
    on a Zen 5 EPYC: 13% of rows differ in some bit), every row count then gets the bits of the
    learner's many-row product (rlvr.rollout.matched)."""

    def run(kept: Any, x: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        return form.run(kept, x.repeat(2, 1), b)[:1] if len(x) == 1 else form.run(kept, x, b)

    return form._replace(run=run, paired=True)


FORMS["onednn_paired"] = _paired(FORMS["onednn"])
FORMS["linear_paired"] = _paired(FORMS["linear"])


ROWS = (1, 2, 4, 8, 16, 32, 64)
"""The row buckets of a `Plan`: rows r run in the form of the smallest bucket ≥ r (64 for more)."""

Plan = tuple[str, ...]
"""A form name (`FORMS`) for each bucket of `ROWS`."""


def bucket(rows: int) -> int:
    """The index in `ROWS` whose form runs `rows` rows."""
    return min((rows - 1).bit_length(), len(ROWS) - 1)


def joined(parts: list[torch.Tensor]) -> torch.Tensor:
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


def form_unavailable(name: str, dtype: torch.dtype) -> str | None:
    """Why the form `name` cannot run a small weight of `dtype` here (a PyTorch built without MKL
    or oneDNN, a CPU the library has no kernel for), or gives it a wrong product (beyond bf16's
    rounding, 2^-7 of Σ|x·w| + |b|, at 1, 3, 8 and 17 rows, with and without a bias; or one that
    sums in fewer bits than fp32: 2048 plus a thousand ones, which a float16 or bf16 sum leaves at
    2048), or None."""
    dtypes = FORMS[name].dtypes
    if dtypes is not None and dtype not in dtypes:
        return f"the {name} form keeps a copy exact only for {' and '.join(map(str, sorted(dtypes, key=str)))} weights, not {dtype}"
    if name == "onednn" and not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    if name == "mkl" and not torch.backends.mkl.is_available():
        return "this PyTorch has no MKL"
    gen = torch.Generator().manual_seed(0)
    w, bias = torch.randn(24, 16, generator=gen).to(dtype), torch.randn(24, generator=gen).to(dtype)
    ones = torch.ones(24, 1001, dtype=dtype)
    try:
        kept, kept_ones = FORMS[name].prepare(w), FORMS[name].prepare(ones)
        for rows in (1, 3, PACK_ROWS, 17):  # one row, a few, the packed count, more
            x = torch.randn(rows, 16, generator=gen).to(dtype)
            for k, weight, x, b in ((kept, w, x, None), (kept, w, x, bias),
                                    (kept_ones, ones, torch.ones(rows, 1001, dtype=dtype).index_fill_(1, torch.tensor([0]), 2048), None)):
                y = FORMS[name].run(k, x, b).double()
                added = torch.zeros((), dtype=torch.float64) if b is None else b.double()
                exact = x.double() @ weight.double().T + added
                if not ((y - exact).abs() <= 2**-7 * (x.double().abs() @ weight.double().abs().T + added.abs())).all():
                    return f"{name} gives a wrong product at {rows} rows{' with a bias' * (b is not None)} here"
    except (AttributeError, RuntimeError, NotImplementedError) as e:
        return (str(e).splitlines() or [type(e).__name__])[0][:160]
    return None


def fused(layer: Any) -> tuple[torch.Tensor, ...]:
    """A Llama-family decoder layer's [out, in] weights in the order a step multiplies them: q/k/v
    fused, the attention output, the MLP's gate/up fused, its down projection."""
    return tuple(joined(parts) for parts in fused_parts(layer))


def fused_parts(layer: Any) -> tuple[list[torch.Tensor], ...]:
    """`fused`'s weights as the model's own parameters (detached, not copied), each a list of the
    weights whose rows it joins."""
    attn, mlp = layer.self_attn, layer.mlp
    return ([attn.q_proj.weight.detach(), attn.k_proj.weight.detach(), attn.v_proj.weight.detach()],
            [attn.o_proj.weight.detach()],
            [mlp.gate_proj.weight.detach(), mlp.up_proj.weight.detach()],
            [mlp.down_proj.weight.detach()])


QKV = ("q_proj", "k_proj", "v_proj")
"""The projections the decoder fuses into one product (`fused`)."""


def fused_bias(layer: Any) -> torch.Tensor | None:
    """The q/k/v projections' biases joined as `fused` joins their weights (Qwen2 has them), or None
    where they have none (ValueError where only some have one: `partial_qkv_bias` screens it out)."""
    attn = layer.self_attn
    biases = [getattr(attn, name).bias for name in QKV]
    if all(b is None for b in biases):
        return None
    if any(b is None for b in biases):
        raise ValueError(f"{type(attn).__name__}: the decoder fuses q/k/v, and only some of them have a bias")
    return torch.cat([b.detach() for b in biases])


def partial_qkv_bias(model: Any) -> bool:
    """Whether some layer has a bias on some of its q/k/v projections but not all, which `fused_bias`
    cannot join (the static decoder and the matched probe refuse such a model)."""
    return any(len({getattr(layer.self_attn, name).bias is None for name in QKV}) > 1 for layer in model.model.layers)


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
