"""Matrix-product kernels at the decoder's small batch sizes, shape by shape (issue 20's batch-1..16
lead): is the static decoder's `x @ W` (MKL's sgemm on a contiguous [in, out] matrix) the fastest
way to run the bundled model's shapes when only a few rows are decoding?

    python bench/small_gemm.py [--threads N] [--batches 1,2,4,8,16,32,64]

Variants, all the same product up to summation order (fp16w: of the float16-rounded weight):
  x@W       the static decoder's form: x [M, in] @ W [in, out], contiguous
  linear    F.linear(x, W_t) on the [out, in] weight (nn.Linear, the model's lm_head)
  (Wx)^T    (W_t @ x^T)^T: the same product with the long side as the rows
  Dense     the static decoder's fp32 projection: x@W at one row, (Wx)^T from two
  mklpack   MKL's packed sgemm (torch.ops.mkl._mkl_linear on a weight packed once, for 8 rows, by
            _mkl_reorder_linear_weight; every row count checked against the reference below)
  onednn    oneDNN's prepacked linear (torch.ops.mkldnn._linear_pointwise on a weight reordered
            by _reorder_linear_weight for batch 8), what inductor's CPU backend calls
  fp16w     fbgemm's prepacked float16 weight, fp32 activations and sums (`engine.dtype =
            "float16"`, rlvr.rollout.static_decode.Float16): the product of the rounded weight
Prints ms per product and the fastest variant per (shape, M); nothing here is a test.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlvr.rollout.static_decode import Dense, Float16, weights_unavailable

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


def variants(w_io: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    w_oi = w_io.T.contiguous()
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
        "x@W": lambda x: x @ w_io,
        "linear": lambda x: F.linear(x, w_oi),
        "(Wx)^T": lambda x: (w_oi @ x.T).T,  # without Dense's copy back to row-major
        "Dense": Dense(w_oi),  # the static decoder's fp32 projection: x@W at one row, (Wx)^T from two
    }
    try:
        mkl_packed = torch.ops.mkl._mkl_reorder_linear_weight(w_oi, 8)
        out["mklpack"] = lambda x: torch.ops.mkl._mkl_linear(x, mkl_packed, w_oi, None, x.shape[0])
    except (RuntimeError, AttributeError):  # a torch build without MKL
        pass
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w_oi, 8)
        out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):  # a torch build without oneDNN's linear
        pass

    if weights_unavailable("float16") is None:
        out["fp16w"] = Float16(w_oi)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--batches", default="1,2,4,8,16,32,64")
    ap.add_argument("--stack", action="store_true",
                    help="also time the 30 layers' products plus the head in turn, distinct weights: a "
                         "working set far bigger than the cache, as in decoding")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    batches = [int(b) for b in args.batches.split(",")]
    print(f"threads {args.threads}; ms per product (best of 3), fastest marked *")
    for name, (k, n) in SHAPES.items():
        w = torch.randn(k, n) * 0.02
        fns = variants(w)
        print(f"\n{name} [{k} x {n}]   " + "".join(f"{v:>10}" for v in fns))
        for m in batches:
            x = torch.randn(m, k)
            for v, fn in fns.items():  # every variant is the same product (fp32 rounding over k terms)
                ref = x.double() @ (w.half() if v == "fp16w" else w).double()
                assert torch.allclose(fn(x).double(), ref, atol=1e-4, rtol=1e-4), (name, m, v)
            times = {v: best_of(lambda: fn(x)) for v, fn in fns.items()}
            fastest = min(times, key=times.__getitem__)
            cells = "".join(f"{t:>9.3f}{'*' if v == fastest else ' '}" for v, t in times.items())
            print(f"  M={m:<4}          {cells}")
    if args.stack:
        stack(batches)


def stack(batches: list[int], layers: int = 30) -> None:
    """One decode step's products: every layer's qkv, o, gate_up and down, then the head."""
    shapes = [SHAPES[s] for _ in range(layers) for s in ("qkv", "o", "gate_up", "down")] + [SHAPES["lm_head"]]
    products = [variants(torch.randn(k, n) * 0.02) for k, n in shapes]
    names = list(products[0])
    print(f"\nstack: {layers} layers x 4 products + head, ms per step   " + "".join(f"{v:>10}" for v in names))
    for m in batches:
        inputs = [torch.randn(m, k) for k, _ in shapes]
        times = {}
        for v in names:
            fns = [p[v] for p in products]
            times[v] = best_of(lambda: [fn(x) for fn, x in zip(fns, inputs)], seconds=0.6)
        fastest = min(times, key=times.__getitem__)
        cells = "".join(f"{t:>9.2f}{'*' if v == fastest else ' '}" for v, t in times.items())
        print(f"  M={m:<4}          {cells}")


if __name__ == "__main__":
    main()
