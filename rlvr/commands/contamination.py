"""`rlvr contamination`: was a model trained on these prompts? Self-Critique and Min-K% scores, with their AUC."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rlvr.commands.progress import counting
from rlvr.config import RunConfig, load_config
from rlvr.data.sampler import UniformSampler
from rlvr.eval.contamination import METHODS, contamination_report
from rlvr.models import load_model, load_tokenizer, resolve_dtype, resolve_model
from rlvr.train.data import load_examples


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    members, non_members = _prompts(args, cfg)
    methods = list(METHODS) if args.method == "both" else [args.method]
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    model = load_model(path, resolve_dtype("auto")).eval()
    print(f"contamination: {len(members)} members, {len(non_members)} non-members, {', '.join(methods)}",
          file=sys.stderr)
    totals = {m: (2 if m == "self_critique" else 1) * (len(members) + len(non_members)) for m in methods}
    with counting(totals) as advance:
        report = contamination_report(
            model, tokenizer, members, non_members, methods=methods, k=args.k,
            max_new_tokens=args.max_new_tokens or cfg.sampling.max_new_tokens, system_prompt=cfg.task.system_prompt,
            batch_size=args.batch_size, progress=advance)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": args.model, "checkpoint": path, "members": len(members),
                               "non_members": len(non_members), **report}, indent=2) + "\n")
    print("| method | AUC | mean (members) | mean (non-members) |\n|---|---|---|---|")
    for m in methods:
        mean = report["mean"][m]
        print(f"| {m} | {report['auc'][m]:.3f} | {mean['members']:.4f} | {mean['non_members']:.4f} |")
    print(f"written: {out}", file=sys.stderr)
    return 0


def _prompts(args: argparse.Namespace, cfg: RunConfig) -> tuple[list[str], list[str]]:
    """(members, non-members): from the JSONL files where given, else from the config (see the help)."""
    n = args.prompts
    if n < 1:
        raise ValueError("--prompts must be at least 1")
    if args.members and args.non_members:
        return _read_prompts(Path(args.members))[:n], _read_prompts(Path(args.non_members))[:n]
    train, held = load_examples(cfg)
    # the training loop draws prompts with this sampler and seed, so these are the first it trains on
    drawn = UniformSampler(len(train), cfg.seed).next_batch(min(n, len(train)))
    members = _read_prompts(Path(args.members))[:n] if args.members else [train[i].prompt for i in drawn]
    non_members = _read_prompts(Path(args.non_members))[:n] if args.non_members else [ex.prompt for ex in held[:n]]
    return members, non_members


def _read_prompts(path: Path) -> list[str]:
    """The "prompt" field of each non-blank line of a JSONL file."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}: not JSON ({err.msg})") from err
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(f'{path}, line {number}: expected an object with a string "prompt" field')
        prompts.append(row["prompt"])
    return prompts
