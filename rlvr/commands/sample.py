"""`rlvr sample`: completions of prompts from a model, checkpoint folder or run directory."""

from __future__ import annotations

import argparse
import json
import sys

from rlvr.data import render_prompt
from rlvr.models import eos_token_ids, load_policy, resolve_dtype, resolve_model
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams


def run(args: argparse.Namespace) -> int:
    model_spec = resolve_model(args.model)  # a run directory: its latest checkpoint
    prompts = args.prompts or [line.strip() for line in sys.stdin if line.strip()]
    if not prompts:
        raise ValueError("no prompts given (pass them as arguments or one per line on stdin)")
    model, tokenizer, _ = load_policy(model_spec, resolve_dtype("auto"))  # a VLM answers text prompts too
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer), seed=args.seed)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, n=args.n)
    ids = [render_prompt(tokenizer, p, args.system) for p in prompts]
    for prompt, group in zip(prompts, engine.generate(ids, params)):
        for c in group:
            if args.json:
                print(json.dumps({"prompt": prompt, "completion": c.text, "token_ids": c.token_ids,
                                  "logprobs": c.logprobs, "finish_reason": c.finish_reason}))
            else:
                print(f"### {prompt}\n{c.text}\n[{c.finish_reason}, {len(c.token_ids)} tokens]\n")
    return 0
