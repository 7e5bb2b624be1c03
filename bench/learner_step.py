"""Peak memory and speed of one learner update on the bundled model (not a test: run by hand).

    python bench/learner_step.py --batch 16 --prompt 64 --completion 192 --precision fp32
    python bench/learner_step.py --naive ...   # full-vocabulary logits, for comparison
    python bench/learner_step.py --optimizer adamw_compact --micro-batch 2   # train.optimizer's memory
    python bench/learner_step.py --chunk 1024 --no-malloc-tuning --profile   # the variants in docs/LOG.md

Prints one JSON line: seconds, tokens/s and peak RSS of the process (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import torch

from rlvr.bench import fake_groups
from rlvr.models import load_model
from rlvr.runtime import keep_freed_memory
from rlvr.train.learner import Learner
from rlvr.train.settings import LossSettings, Passes
from rlvr.train.update import UpdateSettings, update_policy
from rlvr.types import Group


def naive_step(model: torch.nn.Module, learner: Learner, groups: list[Group]) -> None:
    """The textbook way: full logits, fp32 log-softmax over the whole vocabulary."""
    samples = [s for g in groups for s in g.samples]
    ids = torch.tensor([list(s.prompt_ids + s.completion.token_ids) for s in samples])
    p = len(samples[0].prompt_ids)
    logits = model(input_ids=ids).logits.float()
    logprobs = logits[:, p - 1 : -1].log_softmax(-1).gather(-1, ids[:, p:, None]).squeeze(-1)
    adv = torch.tensor([s.reward - 0.5 for s in samples])[:, None]
    (-(torch.exp(logprobs - logprobs.detach()) * adv).mean()).backward()
    learner.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=192)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--optimizer", default="adamw", choices=["adamw", "adamw_compact"], help="train.optimizer")
    ap.add_argument("--naive", action="store_true")
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing")
    ap.add_argument("--steps", type=int, default=2, help="timed: the last one (the first primes allocators)")
    ap.add_argument("--chunk", type=int, default=256, help="LM-head chunk (train.logprob_chunk)")
    ap.add_argument("--no-malloc-tuning", action="store_true", help="skip rlvr.runtime.keep_freed_memory()")
    ap.add_argument("--profile", action="store_true", help="print the top ops of the last update")
    args = ap.parse_args()
    if not args.no_malloc_tuning:
        keep_freed_memory()
    model = load_model("builtin:smollm2-135m-instruct", args.precision)
    learner = Learner(model, lr=1e-6, optimizer=args.optimizer)
    groups = fake_groups(args.batch, args.group, args.prompt, args.completion, model.config.vocab_size)
    settings = UpdateSettings(loss=LossSettings(max_tokens=args.completion),
                              passes=Passes(micro_batch_size=args.micro_batch, logprob_chunk=args.chunk))
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for step in range(args.steps):
        profiler = torch.profiler.profile() if args.profile and step == args.steps - 1 else None
        if profiler:
            profiler.start()
        start = time.perf_counter()
        if args.naive:
            naive_step(model, learner, groups)
        else:
            update_policy(learner, groups, settings, pad_token_id=0)
        seconds = time.perf_counter() - start
        if profiler:
            profiler.stop()
            print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    tokens = args.batch * (args.prompt + args.completion)
    print(json.dumps({"mode": "naive" if args.naive else "rlvr", "precision": args.precision,
                      "optimizer": args.optimizer, "batch": args.batch,
                      "micro_batch": args.batch if args.naive else args.micro_batch,
                      "checkpointing": args.checkpointing,
                      "tokens": tokens, "seconds": round(seconds, 1), "tokens_per_s": round(tokens / seconds, 1),
                      "rss_after_load_gb": round(base_rss, 2),
                      "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


if __name__ == "__main__":
    main()
