"""`rlvr rm`: train a reward model (outcome or process) from a file, or make preference pairs (or
labelled critique rows, for a generative verifier) from a model's own samples judged by a
config's rewards."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlvr.commands.progress import counting
from rlvr.config import load_config
from rlvr.data.filter import preference_pairs, verdict_rows
from rlvr.rewards.rm_train import Options, train_reward_model
from rlvr.train.data import load_examples


def run(args: argparse.Namespace) -> int:
    if args.rm_command in ("pairs", "verdicts"):
        cfg = load_config(args.config, args.overrides)
        examples = load_examples(cfg)[0][: args.prompts]  # training prompts only: the held-out ones stay unseen
        with counting({"sampling prompts": len(examples)}) as advance:
            if args.rm_command == "pairs":
                rows = preference_pairs(args.model, cfg, examples, n=args.n, per_prompt=args.per_prompt, seed=cfg.seed,
                                        progress=lambda k: advance("sampling prompts", k))
            else:
                rows = verdict_rows(args.model, cfg, examples, n=args.n, extract=args.extract, balance=args.balance,
                                    seed=cfg.seed, progress=lambda k: advance("sampling prompts", k))
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        what = "preference pairs" if args.rm_command == "pairs" else "critique rows (candidate, label)"
        print(f"wrote {len(rows)} {what} from {len(examples)} prompts to {out}", file=sys.stderr)
        return 0
    opts = Options(epochs=args.epochs, lr=args.lr, batch_size=args.batch_size, max_length=args.max_length,
                   eval_fraction=args.eval_fraction, seed=args.seed, center=args.center, separator=args.separator,
                   precision=args.precision)
    report = train_reward_model(args.data, args.model, args.output, opts, eval_data=args.eval_data, kind=args.kind,
                                say=lambda line: print(line, file=sys.stderr, flush=True))
    for name in ("held_out_before", "held_out"):
        if report[name]:
            print(f"{name.replace('_', ' ')}: " + ", ".join(f"{k} {v:.4g}" for k, v in report[name].items()))
    use = ('[[rewards]] fn = "reward_model", kwargs = {model = "%s"}' if report["kind"] == "outcome"
           else 'algo.estimator = "process", algo.kwargs = {prm = "%s"}') % args.output
    print(f"saved to {args.output} (report.json beside the weights); use it with {use}")
    return 0
