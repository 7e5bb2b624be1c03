"""The static decoder's throughput with short and long prompts, for comparing two versions of rlvr
side by side (the engine sharing a prompt's keys and values across its G samples vs copying them).

    PYTHONPATH=/path/to/other/checkout python bench/shared_kv.py --prompt-tokens 0,400 --batch-sizes 1,8,64

Every row is forced to --new-tokens (no EOS); G = min(8, batch) samples per prompt. A prompt of
the bench's task gets --prompt-tokens extra tokens in front (a long system prompt), so the
prompt's share of the cache can be varied. Prints one JSON line per (prompt tokens, batch).
"""

from __future__ import annotations

import argparse
import json
import time

import rlvr
from rlvr.bench import MODEL, grouped_prompts
from rlvr.models import cpu_description, load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt-tokens", default="0,400")
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, "auto")
    filler = tokenizer.encode(" ".join(["The sum of two numbers is their total."] * 60), add_special_tokens=False)
    cpu = cpu_description()
    for extra in (int(x) for x in args.prompt_tokens.split(",")):
        for batch in (int(x) for x in args.batch_sizes.split(",")):
            prompts, group = grouped_prompts(tokenizer, batch)
            ids = [filler[:extra] + p for p in prompts]
            engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch, decoder="static")
            engine.generate(ids[:1], SamplingParams(max_new_tokens=2, n=1))
            rates = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                engine.generate(ids, SamplingParams(max_new_tokens=args.new_tokens, n=group))
                rates.append(batch * args.new_tokens / (time.perf_counter() - start))
            print(json.dumps({"rlvr": rlvr.__file__, "prompt_tokens": len(ids[0]), "batch": batch,
                              "tok_s": [round(r, 1) for r in rates], "dtype": str(model.dtype),
                              "cpu": f"{cpu['model']} ({cpu['family']}/{cpu['model_id']})"}), flush=True)


if __name__ == "__main__":
    main()
