"""What matched numerics (rlvr.rollout.matched) cost: the embedded engine's decode throughput and a
learner update, each with `numerics` "fast" and "matched", side by side in one process.

    python bench/matched_cost.py [--batches 1,8,64] [--new-tokens 64] [--learner 16x64x64]
"""

from __future__ import annotations

import argparse
import json
import time

from rlvr.attention import exact_attention
from rlvr.bench import MODEL, fake_groups, grouped_prompts
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.learner import Learner
from rlvr.train.update import LossSettings, Passes, UpdateSettings, update_policy
from rlvr.types import SamplingParams


def engine_tok_s(numerics: str, batch: int, new_tokens: int) -> float:
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, "bfloat16")
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch, numerics=numerics)  # type: ignore[arg-type]
    ids, group = grouped_prompts(tokenizer, batch)
    params = SamplingParams(max_new_tokens=new_tokens, n=group)
    engine.generate(ids, params)  # warm: kernels, and a one-row call's lazy copies
    start = time.perf_counter()
    engine.generate(ids, params)
    return round(batch * new_tokens / (time.perf_counter() - start), 1)


def learner_s(numerics: str, batch: int, prompt: int, completion: int) -> float:
    model = load_model(MODEL, "bfloat16")
    if numerics == "matched":
        exact_attention(model)
    learner = Learner(model, lr=1e-6)
    groups = fake_groups(batch, min(8, batch), prompt, completion, model.config.vocab_size)
    settings = UpdateSettings(loss=LossSettings(max_tokens=completion), passes=Passes(micro_batch_size=8))
    update_policy(learner, groups, settings, pad_token_id=0)
    start = time.perf_counter()
    update_policy(learner, groups, settings, pad_token_id=0)
    return round(time.perf_counter() - start, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--learner", default="16x64x64", help="samples x prompt x completion tokens")
    args = parser.parse_args()
    for batch in map(int, args.batches.split(",")):
        row = {n: engine_tok_s(n, batch, args.new_tokens) for n in ("fast", "matched")}
        print(json.dumps({"engine_batch": batch, "tok_s": row, "matched_vs_fast": round(row["matched"] / row["fast"], 2)}), flush=True)
    b, p, c = map(int, args.learner.split("x"))
    row = {n: learner_s(n, b, p, c) for n in ("fast", "matched")}
    print(json.dumps({"learner": args.learner, "seconds": row, "matched_vs_fast": round(row["fast"] / row["matched"], 2)}))


if __name__ == "__main__":
    main()
