"""`rlvr filter`: offline difficulty filtering, the training prompts a model solves sometimes."""

from __future__ import annotations

import argparse
import sys

from rlvr.commands.progress import counting
from rlvr.config import load_config
from rlvr.data.filter import pass_rates, write_accepted, write_filtered
from rlvr.train.data import load_examples


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    examples = load_examples(cfg)[0][: args.limit]  # a file's own count, not task.size
    with counting({"rating prompts": len(examples)}) as advance:
        rated = pass_rates(args.model, cfg, examples, n=args.n, progress=lambda k: advance("rating prompts", k))
    kept = write_filtered(rated, args.out, low=args.min, high=args.max, include_low=args.inclusive,
                          include_high=args.inclusive)
    hist = [sum(1 for r in rated if r.rate is not None and round(r.rate * args.n) == k) for k in range(args.n + 1)]
    print("pass rate  prompts\n" + "\n".join(f"{k}/{args.n:<7} {c}" for k, c in enumerate(hist)))
    unknown = sum(1 for r in rated if r.rate is None)
    if unknown:
        print(f"{unknown} prompt(s) got no verdict on any sample (the reward's sandbox or service failed): "
              "left out", file=sys.stderr)
    print(f"kept {kept} of {len(rated)} prompts in {args.out}", file=sys.stderr)
    if args.accepted:
        rows = write_accepted(rated, args.accepted, system_prompt=cfg.task.system_prompt)
        solved = sum(1 for r in rated if r.accepted)
        print(f"wrote {rows} accepted completions of {solved} prompts to {args.accepted}", file=sys.stderr)
    return 0
