"""A decode step's attention in bf16 and in fp32 on this CPU: SDPA against scores, softmax and
weighted values written out, at the bundled model's head layout (3 key/value heads of 64, 3 query
heads each, one query a row), for several rows and key counts.

    python bench/decode_attention.py [--rows 1,8,64] [--keys 64,192]

Prints µs a call. Findings: docs/LOG.md (session 39)."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F


def per_call_us(run: Callable[[], torch.Tensor], reps: int = 300) -> float:
    for _ in range(20):
        run()
    start = time.perf_counter()
    for _ in range(reps):
        run()
    return round((time.perf_counter() - start) / reps * 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,8,64")
    parser.add_argument("--keys", default="64,192")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    for rows in map(int, args.rows.split(",")):
        for keys in map(int, args.keys.split(",")):
            row: dict[str, object] = {"rows": rows, "keys": keys, "threads": torch.get_num_threads()}
            for dtype in (torch.bfloat16, torch.float32):
                q = torch.randn(rows, 3, 3, 64, generator=gen).to(dtype)
                k, v = (torch.randn(rows, 3, keys, 64, generator=gen).to(dtype) for _ in range(2))
                mask = torch.zeros(rows, 1, 1, keys, dtype=dtype)

                def written_out(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                                mask: torch.Tensor = mask, dtype: torch.dtype = dtype) -> torch.Tensor:
                    scores = q @ k.transpose(-1, -2) * 0.125 + mask
                    return scores.float().softmax(-1).to(dtype) @ v

                def sdpa(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v,
                         mask: torch.Tensor = mask) -> torch.Tensor:
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125)

                name = str(dtype).removeprefix("torch.")
                row[f"sdpa_{name}_us"] = per_call_us(sdpa)
                row[f"written_out_{name}_us"] = per_call_us(written_out)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
