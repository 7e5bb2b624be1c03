"""Decode throughput of rlvr's engine vs HF `generate` (`rlvr bench --parts generate`), plus a profile.

    python bench/engine_throughput.py --prompts 8 --group 8 --new-tokens 64 [--profile]
"""

from __future__ import annotations

import argparse
import json

import torch

from rlvr.bench import MODEL, part_generate, prompt_ids
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="print the top ops of a short engine run")
    args = ap.parse_args()
    print(json.dumps(part_generate([args.prompts * args.group], args.new_tokens)))
    if args.profile:
        tok, model = load_tokenizer(MODEL), load_model(MODEL, "auto")
        engine = EmbeddedEngine(model, tok, eos_token_ids=[], max_batch_size=args.prompts * args.group)  # no EOS
        ids = prompt_ids(tok, args.prompts)
        with torch.profiler.profile() as prof:
            engine.generate(ids, SamplingParams(max_new_tokens=16, n=args.group))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
