"""The static decoder's projections on the plan probed on this CPU (rlvr.rollout.weights.
product_plans) against the fixed plan (`RLVR_PRODUCTS=fixed`: in fp32 the plan used before session
15, `x @ W` at one row, `(W xᵀ)ᵀ` beyond, the head `nn.Linear` at one row; in bf16 oneDNN-packed
copies at every row count, as before session 16), in one process, alternating, so both sides see
the same machine load. Engine tokens/s per batch size, the best of `--rounds`.

    python bench/dense_forms.py [--dtype float32|bfloat16] [--batch-sizes 1,2,4,8,16,32,64] [--new-tokens 64]
                                [--rounds 3] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from rlvr.bench import MODEL, grouped_prompts
from rlvr.models import cpu_description, load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.weights import LAZY_AFTER, FusedWeights
from rlvr.types import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--new-tokens", type=int, default=64, help="at least LAZY_AFTER (16) for one row to run its lazy forms from its first step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", default=MODEL)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help='whatever "auto" picks')
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(args.model), load_model(args.model, getattr(torch, args.dtype))
    cpu = cpu_description()
    with torch.no_grad():
        os.environ["RLVR_PRODUCTS"] = "fixed"
        fixed = FusedWeights(model)
        del os.environ["RLVR_PRODUCTS"]
        probed = FusedWeights(model)
    assert probed.plans is not None and fixed.plans is not None
    print(f"{cpu['model']} (family {cpu['family']} model {cpu['model_id']}), {model.dtype}, "
          f"{torch.get_num_threads()} threads; tok/s, best of {args.rounds}\n"
          f"fixed plan:  layers {'/'.join(fixed.plans.layers)}, head {'/'.join(fixed.plans.head)}\n"
          f"probed plan: layers {'/'.join(probed.plans.layers)}, head {'/'.join(probed.plans.head)}")
    sides = {"fixed": fixed, "probed": probed}
    print("| batch | " + " | ".join(sides) + " | ratio |\n|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        ids, group = grouped_prompts(tokenizer, batch)
        engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch, decoder="static")
        best = dict.fromkeys(sides, 0.0)
        for round_ in range(args.rounds + 1):  # round 0 warms both up
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))  # neither side always first
            for name in order:
                engine._fused = (engine._weights_key(), sides[name])  # this side's copies, as the engine would hold them
                start = time.perf_counter()
                tokens = args.new_tokens if round_ else max(args.new_tokens, LAZY_AFTER)  # lazy copies bought
                engine.generate(ids, SamplingParams(max_new_tokens=tokens, n=group))
                if round_:
                    best[name] = max(best[name], batch * args.new_tokens / (time.perf_counter() - start))
        print(f"| {batch} | {best['fixed']:.1f} | {best['probed']:.1f} | {best['probed'] / best['fixed']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
