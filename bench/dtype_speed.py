"""fp32 vs bf16 on this CPU: matrix products and one decode step of the bundled model.

    python bench/dtype_speed.py
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from rlvr.bench import matmul_gflops
from rlvr.models import load_model


def decode_step_seconds(dtype: torch.dtype, batch: int = 64, prompt: int = 60, steps: int = 5) -> float:
    model = load_model("builtin:smollm2-135m-instruct", dtype).eval()
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(100, 1000, (batch, prompt)), past_key_values=cache, use_cache=True,
              logits_to_keep=1)
        token = torch.randint(100, 1000, (batch, 1))
        times = []
        for i in range(steps):
            start = time.perf_counter()
            model(input_ids=token, position_ids=torch.full((batch, 1), prompt + i), past_key_values=cache,
                  use_cache=True)
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    for dtype in (torch.float32, torch.bfloat16):
        print(f"{str(dtype):15s} 2048^3 {matmul_gflops(dtype, 2048, 2048, 2048, reps=10):6.0f} GFLOP/s   "
              f"1280x576x1536 {matmul_gflops(dtype, 1280, 576, 1536, reps=10):6.0f} GFLOP/s   "
              f"decode step B=64 {decode_step_seconds(dtype):.3f} s")
