"""`rlvr bench`: speed side by side (rlvr.bench runs each part in a process of its own)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import rlvr.bench as bench  # its functions looked up when called (the tests replace run_part)
from rlvr.config.sections import TrainConfig
from rlvr.models import cpu_description, cpu_line


def run(args: argparse.Namespace) -> int:
    cpu = cpu_line(cpu_description())  # every figure names the CPU it came from

    def emit(record: dict[str, Any]) -> None:
        print(json.dumps({**record, "cpu": cpu}), flush=True)

    print(f"# rlvr bench, {time.strftime('%Y-%m-%d %H:%M')}, {cpu}", flush=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    model: dict[str, Any] = {"model_spec": args.model} if args.model else {}
    unknown = [p for p in parts if p not in ("generate", "learner", "grpo", "rm", "busy")]
    if unknown:
        raise ValueError(f"unknown bench part {unknown[0]!r}; use generate, learner, grpo, rm, busy")
    for part in parts:
        if part == "generate":
            sizes = [int(b) for b in args.batch_sizes.split(",")]
            ours = bench.run_part("generate", batch_sizes=sizes, new_tokens=args.new_tokens, **model)
            emit(ours)
            emit(_bench_vllm(args, sizes, ours, model))
        elif part == "learner":
            cap = TrainConfig().micro_batch_tokens  # what a run uses by default
            # 8 rows a micro-batch, the same without shared prompts, the default token cap, the smallest
            # memory; then a long system prompt
            for prompt, completion, micro, tokens, checkpointing, share in (
                    (64, 192, 8, None, False, True), (64, 192, 8, None, False, False), (64, 192, 8, cap, False, True),
                    (64, 192, 4, None, True, True), (448, 64, 8, None, False, True), (448, 64, 8, None, False, False)):
                emit(bench.run_part("learner", batch=16, prompt=prompt, completion=completion, micro_batch=micro,
                                    micro_batch_tokens=tokens, checkpointing=checkpointing, share_prompts=share, **model))
        elif part == "rm":
            emit(bench.run_part("rm", **model))
        elif part == "busy":
            emit(bench.compare_busy(steps=args.grpo_steps, **model))
        else:
            for p, g in [tuple(int(x) for x in s.split("x")) for s in args.grpo_shapes.split(",")]:
                emit(bench.compare_grpo(prompts=p, group=g, max_new_tokens=128, steps=args.grpo_steps,
                                        engine_dtype=args.engine_dtype, **model))
    return 0


def _bench_vllm(args: argparse.Namespace, sizes: list[int], ours: dict[str, Any], model: dict[str, Any]) -> dict[str, Any]:
    """vLLM on the same prompts and batches as rlvr's engine (`ours`), with the ratio per batch."""
    python = None if args.vllm_python == "none" else args.vllm_python or bench.vllm_python()
    if python is None:
        reason = "skipped" if args.vllm_python == "none" else "vLLM is not installed here: `make vllm-env`, or --vllm-python"
        return {"part": "generate_vllm", "skipped": reason}
    theirs = bench.run_part("generate_vllm", python=python, batch_sizes=sizes, new_tokens=args.new_tokens,
                            enforce_eager=args.vllm_eager, **model)
    mine = {row["batch"]: row.get("rlvr_static_tok_s") for row in ours.get("rows", [])}
    for row in theirs.get("rows", []):
        if isinstance(mine.get(row["batch"]), float):
            row["rlvr_static_tok_s"] = mine[row["batch"]]
            row["rlvr_vs_vllm"] = round(mine[row["batch"]] / row["vllm_tok_s"], 2)
    return theirs
