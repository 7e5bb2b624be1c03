"""Small products on a quiet and on a busy machine, by torch thread count and OpenMP waiting policy.

    python bench/busy_threads.py

Each configuration runs in a fresh process (OpenMP reads its policy when it loads), timing a decode
step's shapes: [1, 576] x [576, 576] and [8, 576] x [576, 1536], fp32 and bf16, best and median
of 200. "busy": another process spins on one of the cores meanwhile. Prints microseconds."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from rlvr.bench import busy_core

CHILD = r"""
import json, statistics, time, torch
out = {}
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in ((1, 576, 576), (8, 576, 1536)):
        a, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        for _ in range(20):
            torch.nn.functional.linear(a, w)
        times = []
        for _ in range(200):
            t = time.perf_counter()
            torch.nn.functional.linear(a, w)
            times.append((time.perf_counter() - t) * 1e6)
        out[f"{m}x{k}x{n} {str(dtype)[6:]}"] = (round(min(times)), round(statistics.median(times)))
print(json.dumps(out))
"""


def run(threads: int, policy: str | None) -> dict[str, list[int]]:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    env.pop("OMP_WAIT_POLICY", None)
    if policy:
        env["OMP_WAIT_POLICY"] = policy
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(out.stdout))


def main() -> None:
    cores = sorted(os.sched_getaffinity(0))
    configs = [(1, None), (len(cores), None), (len(cores), "passive")]
    for busy in (False, True):
        with busy_core(cores[-1]) if busy else contextlib.nullcontext():
            for threads, policy in configs:
                result = run(threads, policy)
                label = f"{'busy ' if busy else 'quiet'} {threads} thread{'s' if threads > 1 else ''} {policy or 'default'}"
                print(f"{label:<28}" + "  ".join(f"{k}: {v[0]}/{v[1]} µs" for k, v in result.items()), flush=True)


if __name__ == "__main__":
    main()
