"""Matrix-product kernels at the decoder's small batch sizes, shape by shape (issue 20's batch-1..16
lead): is the static decoder's `x @ W` (MKL's sgemm on a contiguous [in, out] matrix) the fastest
way to run the bundled model's shapes when only a few rows are decoding, and what do the
weight-only formats (`engine.dtype = "float16"`, `"int8"`) and torch's int4 kernel gain?

    python bench/small_gemm.py [--threads N] [--batches 1,2,4,8,16,32,64] [--dtype bfloat16] [--stack]

Variants, each the same product up to rounding, of the weight each one stores:
  x@W       the static decoder's form: x [M, in] @ W [in, out], contiguous
  linear    F.linear(x, W_t) on the [out, in] weight (nn.Linear, the model's lm_head)
  (Wx)^T    (W_t @ x^T)^T: the same product with the long side as the rows
  Dense     rlvr.rollout.weights.Dense on its fixed plan (no probe): fp32 x@W at one row, (Wx)^T
            from two; bf16 oneDNN-packed (the onednn variant). An fp32 decoder runs the plan
            probed on its CPU instead, chosen among these variants (bench/dense_forms.py)
  mklpack   MKL's packed sgemm (torch.ops.mkl._mkl_linear on a weight packed once, for 8 rows, by
            _mkl_reorder_linear_weight; fp32 only)
  onednn    oneDNN's prepacked linear (torch.ops.mkldnn._linear_pointwise on a weight reordered
            by _reorder_linear_weight for batch 8), what inductor's CPU backend calls
  half      bf16 only: nn.Linear on a float16 copy, activations cast to float16 (PyTorch's
            float16 kernels, fp32 sums), the decoder's "half" form: exact copies of bf16 weights
  fp16w     `engine.dtype = "float16"` (weights.Float16): fbgemm's prepacked float16
            weight, fp32 activations and sums
  int8w     `engine.dtype = "int8"` (weights.Int8, AVX-512 only): torch's weight-only int8
            kernel with bf16 activations up to its KERNEL_ROWS rows, the dequantized weight beyond
  int4w     torch's weight-only int4 kernel (groups of 32, bf16 activations; AVX-512 only), not an
            engine format: how far 4-bit weights would go
Without --stack each call reuses one weight, which stays in cache; a decode step streams every
weight from memory, which --stack times (30 layers' distinct weights plus the head). Prints ms
per product and the fastest variant per (shape, M); nothing here is a test.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from rlvr.rollout.forms import FORMS, form_unavailable
from rlvr.rollout.weights import Dense, Float16, Int8, weights_unavailable

# the bundled SmolLM2-135M's decode products: hidden 576, 9 heads and 3 kv heads of 64, MLP 1536
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576), "lm_head": (576, 49152)}


def best_of(fn: Callable[[], object], seconds: float = 0.15, rounds: int = 3) -> float:
    """The fastest of `rounds` mean times (ms) over `seconds` each: the least disturbed by a busy machine."""
    fn()
    means = []
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            fn()
            n += 1
        means.append((time.perf_counter() - start) / n * 1e3)
    return min(means)


class Int4:
    """torch's weight-only int4 product on the CPU: groups of 32 along the input, asymmetric
    (w = (q - 8) · scale + zero), bf16 activations and scales."""

    GROUP = 32

    def __init__(self, w_oi: torch.Tensor) -> None:
        n, k = w_oi.shape
        wg = w_oi.float().reshape(n, k // self.GROUP, self.GROUP)
        lo, hi = wg.amin(-1), wg.amax(-1)
        s4 = (hi - lo).clamp_min(1e-8) / 15
        q4 = torch.round((wg - lo[..., None]) / s4[..., None]).clamp(0, 15)
        zeros = lo + 8 * s4
        scales = torch.stack([s4, zeros], dim=-1).bfloat16()  # [n, k/group, 2]: what the kernel reads
        self.w = ((q4 - 8) * scales[..., :1].float() + scales[..., 1:].float()).reshape(n, k)  # [out, in], the weight it stores
        self.scales = scales.transpose(0, 1).contiguous()
        self.packed = torch._convert_weight_to_int4pack_for_cpu(q4.reshape(n, k).to(torch.int32), 2)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(x.bfloat16(), self.packed, self.GROUP, self.scales).to(x.dtype)


def variants(w_io: torch.Tensor) -> tuple[dict[str, Callable[[torch.Tensor], torch.Tensor]], dict[str, torch.Tensor]]:
    """Each variant's product, and the [in, out] weight each stores where it is not `w_io` itself."""
    w_oi = w_io.T.contiguous()

    def form(name: str) -> Callable[[torch.Tensor], torch.Tensor]:  # the decoder's own form (rlvr.rollout.forms.FORMS)
        run, kept = FORMS[name].run, FORMS[name].prepare(w_oi)
        return lambda x: run(kept, x, None)

    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "x@W": form("xw"),
        "linear": form("linear"),
        "(Wx)^T": lambda x: (w_oi @ x.T).T,  # without Dense's copy back to row-major
        "Dense": Dense(w_oi),  # the static decoder's projection on the model's own weights
    }
    stored: dict[str, torch.Tensor] = {}
    if w_io.dtype == torch.float32 and form_unavailable("mkl", w_io.dtype) is None:
        out["mklpack"] = form("mkl")
    if form_unavailable("onednn", w_io.dtype) is None:
        out["onednn"] = form("onednn")
    if form_unavailable("half", w_io.dtype) is None:
        out["half"] = form("half")
    if weights_unavailable("float16") is None:
        out["fp16w"], stored["fp16w"] = Float16(w_oi), w_io.half()
    if weights_unavailable("int8") is None:
        int8 = Int8(w_oi)
        out["int8w"], stored["int8w"] = int8, (int8.q.double() * int8.scale.double()[:, None]).T
        int4 = Int4(w_oi)
        out["int4w"], stored["int4w"] = int4, int4.w.T
    return out, stored


def tolerance(variant: str, dtype: torch.dtype) -> float:
    """The largest error allowed, relative to Σ|x||w| (the bound of any summation-order error):
    bf16 activations or results round each term or the sum by 2^-8, twice at most; fp32 by 2^-24
    per addition, far under 1e-5 over these sums."""
    return 2**-7 if dtype == torch.bfloat16 or variant in ("int8w", "int4w") else 1e-5


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the model's dtype: the weights and activations of the plain variants")
    ap.add_argument("--stack", action="store_true",
                    help="also time the 30 layers' products plus the head in turn, distinct weights: a "
                         "working set far bigger than the cache, as in decoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"torch {torch.__version__}, {args.threads} threads, {args.dtype}; ms per product (best of 3), fastest marked *")
    for name, (k, n) in SHAPES.items():
        w = (torch.randn(k, n) * 0.02).to(dtype)
        fns, stored = variants(w)
        print(f"\n{name} [{k} x {n}]   " + "".join(f"{v:>10}" for v in fns))
        for m in batches:
            x = torch.randn(m, k).to(dtype)
            for v, fn in fns.items():  # every variant is the same product of the weight it stores
                w_ref = stored.get(v, w).double()
                bound = x.double().abs() @ w_ref.abs()
                err = (fn(x).double() - x.double() @ w_ref).abs()
                assert (err <= tolerance(v, dtype) * bound).all(), (name, m, v, float((err / bound).max()))
            times = {v: best_of(lambda: fn(x)) for v, fn in fns.items()}
            fastest = min(times, key=times.__getitem__)
            cells = "".join(f"{t:>9.3f}{'*' if v == fastest else ' '}" for v, t in times.items())
            print(f"  M={m:<4}          {cells}")
    if args.stack:
        stack(batches, dtype)


def stack(batches: list[int], dtype: torch.dtype, layers: int = 30) -> None:
    """One decode step's products: every layer's qkv, o, gate_up and down, then the head."""
    shapes = [SHAPES[s] for _ in range(layers) for s in ("qkv", "o", "gate_up", "down")] + [SHAPES["lm_head"]]
    products = [variants((torch.randn(k, n) * 0.02).to(dtype))[0] for k, n in shapes]
    names = list(products[0])
    print(f"\nstack: {layers} layers x 4 products + head, ms per step   " + "".join(f"{v:>10}" for v in names))
    for m in batches:
        inputs = [torch.randn(m, k).to(dtype) for k, _ in shapes]
        times = {}
        for v in names:
            fns = [p[v] for p in products]
            times[v] = best_of(lambda: [fn(x) for fn, x in zip(fns, inputs)], seconds=0.6)
        fastest = min(times, key=times.__getitem__)
        cells = "".join(f"{t:>9.2f}{'*' if v == fastest else ' '}" for v, t in times.items())
        print(f"  M={m:<4}          {cells}")


if __name__ == "__main__":
    main()
