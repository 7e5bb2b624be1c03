"""`rlvr eval`: pass@k, maj@k and the rest of models on a config's held-out prompts."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlvr.commands.progress import Stages
from rlvr.config import load_config
from rlvr.eval.run import compared, evaluate_model, markdown_table, write_results


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides) + ([f'task.name="{args.task}"'] if args.task else [])
    cfg = load_config(args.config, overrides)
    ks = sorted({int(k) for k in args.k.split(",") if k.strip()})
    max_new = args.max_new_tokens or cfg.sampling.max_new_tokens
    temperature = cfg.sampling.temperature if args.temperature is None else args.temperature
    judge = {"fn": args.cot_judge, "kwargs": json.loads(args.cot_judge_kwargs)} if args.cot_judge else None
    with Stages("rlvr eval") as stages:  # where stderr is a file: a line per stage, and counts
        results = compared([evaluate_model(m, cfg, n=args.n, ks=ks, prompts=args.prompts, temperature=temperature,
                                           max_new_tokens=max_new, seed=args.seed, cot_judge=judge,
                                           stage=stages.stage, progress=stages.advance) for m in args.model])
    json_path, md_path = write_results(results, ks, Path(args.out))
    print(markdown_table(results, ks), end="")
    print(f"written: {json_path}, {md_path}", file=sys.stderr)
    return 0
