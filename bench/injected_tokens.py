"""The learner on multi-turn episodes: injected tokens scored, or only run (not a test: by hand).

    python bench/injected_tokens.py                       # guess_number's shape, one thread
    python bench/injected_tokens.py --turns 3 --sampled 64 --injected 40 --threads 2

A multi-turn episode's completion interleaves the policy's actions with observations the
environment injected (loss mask 0). `rlvr.train.batches.sample_logprobs` runs the injected
tokens (later actions attend to them) but scores only the trained ones, and stops each row at
its last trained token. The "every token" side is `sample_logprobs` as it was before that change
(the same choice of shared prompts or whole rows, the LM head and its softmax at every
completion token, the loss mask applied afterwards). Both sides run the same update (GRPO) on
the same random episodes in one process, alternating, and the best of ``--repeats`` is kept;
their gradients are compared too (equal to fp32 rounding: no KL in the reward here, the one
place the injected tokens' scores were read). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from rlvr.models import cpu_description, load_model
from rlvr.train import batches
from rlvr.train import update as update_module
from rlvr.train.logprobs import can_share_prompts, shared_prompt_logprobs, token_logprobs
from rlvr.train.settings import Passes
from rlvr.train.update import UpdateSettings, update_policy
from rlvr.types import Completion, Group, Sample


def episodes(prompts: int, group: int, prompt: int, turns: int, sampled: int, injected: int, trailing: bool,
             vocab: int) -> list[Group]:
    """Random episodes: ``turns`` actions of ``sampled`` tokens, an observation of ``injected``
    tokens after each (after the last too, with ``trailing``); alternating rewards."""
    gen = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, vocab, (n,), generator=gen).tolist()  # noqa: E731
    groups = []
    for p in range(prompts):
        prompt_ids = tuple(ids(prompt))
        rows = []
        for k in range(group):
            tokens: list[int] = []
            mask: list[int] = []
            for t in range(turns):
                tokens += ids(sampled)
                mask += [1] * sampled
                if t < turns - 1 or trailing:
                    tokens += ids(injected)
                    mask += [0] * injected
            c = Completion(tuple(tokens), tuple(-1.0 if m else 0.0 for m in mask), "length", "", loss_mask=tuple(mask))
            rows.append(Sample(prompt_ids, c, float(k % 2), {}, p))
        groups.append(Group("", tuple(rows)))
    return groups


def every_token(model: Any, rows: list[Sample], batch: dict[str, torch.Tensor], s: UpdateSettings,
                pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_logprobs` as it was before (9ab368f^): the same choice between shared prompts and
    whole rows, but every completion token scored and every column run (both sides pack a
    prompt's completions into shared rows since session 17, rlvr.train.logprobs.completion_lanes)."""
    if not (s.passes.share_prompts and batches.shares_prompts(rows) and can_share_prompts(model)):
        return token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["completion_mask"],
                              temperature=s.passes.temperature, chunk_size=s.passes.logprob_chunk)
    prompts: dict[Any, int] = {}
    row_prompt = [prompts.setdefault(x.prompt_key, len(prompts)) for x in rows]
    lp_N, ent_N = shared_prompt_logprobs(model, [list(ids) for ids, _ in prompts],
                                         [list(x.completion.token_ids) for x in rows], row_prompt, pad,
                                         temperature=s.passes.temperature, chunk_size=s.passes.logprob_chunk)
    where_BT = batch["completion_mask"]
    zeros = torch.zeros(where_BT.shape, dtype=lp_N.dtype, device=where_BT.device)
    return zeros.masked_scatter(where_BT, lp_N), zeros.masked_scatter(where_BT, ent_N)


class Recorder:
    """A learner that keeps its gradients and never steps, so every repeat sees the same weights."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def step(self) -> float:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--turns", type=int, default=6, help="guess_number: 6 guesses")
    ap.add_argument("--sampled", type=int, default=8, help="tokens an action (guess_number: max_new_tokens 8)")
    ap.add_argument("--injected", type=int, default=17, help="tokens an observation")
    ap.add_argument("--trailing", action="store_true", help="an observation after the last action too")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--whole", action="store_true", help="train.share_prompts = false: whole rows on both sides")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model("builtin:smollm2-135m-instruct", args.precision)
    model.train()
    groups = episodes(args.prompts, args.group, args.prompt, args.turns, args.sampled, args.injected, args.trailing,
                      model.config.vocab_size)
    settings = UpdateSettings(passes=Passes(micro_batch_size=args.micro_batch, share_prompts=not args.whole))
    sides = {"scored": batches.sample_logprobs, "every_token": every_token}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    for _ in range(args.repeats):
        for name, fn in sides.items():
            recorder = Recorder(model)
            original = update_module.sample_logprobs
            update_module.sample_logprobs = fn  # type: ignore[assignment]
            try:
                start = time.perf_counter()
                update_policy(recorder, groups, settings, pad_token_id=0)  # type: ignore[arg-type]
                seconds[name].append(time.perf_counter() - start)
            finally:
                update_module.sample_logprobs = original
            grads[name] = recorder.grads
    rel = max(float((grads["scored"][n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in grads["every_token"].items())
    row = groups[0].samples[0].completion
    best = {name: min(v) for name, v in seconds.items()}
    print(json.dumps({"cpu": cpu_description(), "threads": args.threads, "precision": args.precision,
                      "rows": args.prompts * args.group, "prompt": args.prompt, "completion": len(row.token_ids),
                      "trained": row.trainable(), "shared_prompts": not args.whole, "seconds": {k: [round(x, 2) for x in v] for k, v in seconds.items()},
                      "speedup": round(best["every_token"] / best["scored"], 3),
                      "grad_rel_diff_max": rel}))


if __name__ == "__main__":
    main()
