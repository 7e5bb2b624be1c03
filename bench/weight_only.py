"""Torch's weight-only int8/int4 products against the model-dtype product, on the products the
static decoder runs for SmolLM2-135M (fused q/k/v, attention output, fused gate/up, MLP down,
output head), at a few rows. Microseconds a call, best of `--repeat` rounds of `--calls` calls.
Each call reuses one weight, which stays in cache: a real decode step streams every weight from
memory (docs/LOG.md, session 13), so these times are the kernels' compute, not a step's.

    OMP_NUM_THREADS=1 python bench/weight_only.py --rows 1,4,8 --dtype bfloat16

On Zen 3 (AVX2) both int kernels ran 4.7-15x slower than fp32 at one row (docs/LOG.md, session
12); this reruns the comparison on whatever CPU it is run on.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = [("q/k/v", 576, 960), ("o", 576, 576), ("gate/up", 576, 3072), ("down", 1536, 576), ("head", 576, 49152)]


def timed(fn, calls: int, repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,4,8")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, activations {args.dtype}")
    print("| rows × (in → out) | model dtype `x @ Wᵀ` | model dtype `x @ W` | int8 weight-only | int4 weight-only (group 32) |")
    print("|---|---|---|---|---|")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, k, n in SHAPES:
            w = torch.randn(n, k) * 0.05
            x = torch.randn(rows, k).to(dtype)
            w_oi = w.to(dtype)
            w_io = w_oi.T.contiguous()
            scale = w.abs().amax(dim=1) / 127
            w8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
            s8 = scale.to(dtype)
            group = 32
            wg = w.reshape(n, k // group, group)
            lo, hi = wg.amin(-1), wg.amax(-1)
            s4 = (hi - lo).clamp_min(1e-8) / 15
            q4 = torch.round((wg - lo[..., None]) / s4[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
            zeros = lo + 8 * s4  # torch's int4 kernel: w = (q - 8) * scale + zero
            sz = torch.stack([s4, zeros], dim=-1).transpose(0, 1).contiguous().to(dtype)  # [k/group, n, 2]
            try:
                packed4 = torch._convert_weight_to_int4pack_for_cpu(q4, 2)
                int4 = lambda: torch._weight_int4pack_mm_for_cpu(x, packed4, group, sz)  # noqa: E731
                t4 = f"{timed(int4, args.calls, args.repeat):,.0f}"
            except RuntimeError as e:
                t4 = f"n/a ({str(e)[:40]})"
            t_lin = timed(lambda: torch.nn.functional.linear(x, w_oi), args.calls, args.repeat)
            t_io = timed(lambda: x @ w_io, args.calls, args.repeat)
            t8 = timed(lambda: torch._weight_int8pack_mm(x, w8, s8), args.calls, args.repeat)
            print(f"| {rows} × ({k:,} → {n:,}) {name} | {t_lin:,.0f} | {t_io:,.0f} | {t8:,.0f} | {t4} |", flush=True)


if __name__ == "__main__":
    main()
