"""Decode throughput of rlvr's engine vs HF `generate`, same prompts, every row forced to full length.

    python bench/engine_throughput.py --prompts 8 --group 8 --new-tokens 64 [--profile]
"""

from __future__ import annotations

import argparse
import time

import torch

from rlvr.data import reasoning_gym_examples, render_prompt
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
    tok = load_tokenizer("builtin:smollm2-135m-instruct")
    model = load_model("builtin:smollm2-135m-instruct", "auto")
    engine = EmbeddedEngine(model, tok, eos_token_ids=[], max_batch_size=args.prompts * args.group)  # no EOS
    params = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    examples = reasoning_gym_examples("chain_sum", size=args.prompts, seed=0, params=params)
    ids = [render_prompt(tok, ex.prompt) for ex in examples]
    total = args.prompts * args.group * args.new_tokens
    engine.generate(ids[:1], SamplingParams(max_new_tokens=4, n=2))  # warm-up
    start = time.perf_counter()
    engine.generate(ids, SamplingParams(max_new_tokens=args.new_tokens, n=args.group))
    ours = time.perf_counter() - start
    tok.padding_side = "left"
    batch = tok.pad({"input_ids": [i for i in ids for _ in range(args.group)]}, return_tensors="pt")
    start = time.perf_counter()
    model.generate(**batch, do_sample=True, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                   top_k=0, top_p=1.0, temperature=1.0, pad_token_id=tok.pad_token_id)
    theirs = time.perf_counter() - start
    print(f"dtype {model.dtype}, batch {args.prompts * args.group}, {args.new_tokens} new tokens: "
          f"rlvr {total / ours:.0f} tok/s, HF generate {total / theirs:.0f} tok/s, ratio {theirs / ours:.2f}")
    if args.profile:
        with torch.profiler.profile() as prof:
            engine.generate(ids, SamplingParams(max_new_tokens=16, n=args.group))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=10))


if __name__ == "__main__":
    main()
