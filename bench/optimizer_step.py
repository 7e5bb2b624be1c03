"""Time and memory of one optimizer step on the bundled model's weights (not a test: run by hand).

    python bench/optimizer_step.py [--repeats 3]

Steps torch's fused AdamW and rlvr's CompactAdamW (train.optimizer = "adamw_compact") on copies
of SmolLM2-135M's fp32 weights with a fixed random gradient, alternating, and prints one JSON
line per optimizer: the median seconds of a step (wall and this process's CPU time) and the bytes
of optimizer state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rlvr.models import load_model
from rlvr.train.compact_adamw import CompactAdamW


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = load_model("builtin:smollm2-135m-instruct", "fp32")
    params = {name: [p.detach().clone().requires_grad_(True) for p in model.parameters()]
              for name in ("adamw", "adamw_compact")}
    gen = torch.Generator().manual_seed(0)
    for ps in params.values():
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    optimizers = {"adamw": torch.optim.AdamW(params["adamw"], lr=1e-6, fused=True),
                  "adamw_compact": CompactAdamW(params["adamw_compact"], lr=1e-6)}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in optimizers}
    for name, opt in optimizers.items():
        opt.step()  # allocates the state
    for _ in range(args.repeats):
        for name, opt in optimizers.items():
            wall, cpu = time.perf_counter(), time.process_time()
            opt.step()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    for name, opt in optimizers.items():
        state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                          if isinstance(t, torch.Tensor))
        print(json.dumps({"optimizer": name, "threads": torch.get_num_threads(),
                          "step_s": round(statistics.median(w for w, _ in times[name]), 3),
                          "step_cpu_s": round(statistics.median(c for _, c in times[name]), 3),
                          "state_gb": round(state_bytes / 1e9, 3)}))


if __name__ == "__main__":
    main()
