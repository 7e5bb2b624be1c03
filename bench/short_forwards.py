"""Matched numerics on forwards of a few tokens: the bundled model in bf16, one prompt of 1-4 tokens
alone, one sample of 2 tokens, the engine's sampled log-probs against the learner's (the shared-
prompt layout and whole rows). A pass of 1-3 tokens runs products of 1-3 rows, which some CPUs
round otherwise than many rows; both sides pad such a pass to `rlvr.models.FEWEST_ROWS`.

    python bench/short_forwards.py [--prompts 40]

Prints, per prompt width, the largest |engine − learner| at each token and how many log-probs are
beyond 1e-4. Findings: docs/LOG.md (session 40)."""

from __future__ import annotations

import argparse
import json

import torch

from rlvr.bench import MODEL
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.logprobs import shared_prompt_logprobs, token_logprobs
from rlvr.types import SamplingParams

TEXT = ("Question: what is 12 plus 30? Answer: 42. The quick brown fox jumps over the lazy dog while the cat "
        "sleeps on a warm mat near the window of an old house in the hills.")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=40)
    args = parser.parse_args()
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, "auto")
    model.eval()
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], seed=0, numerics="matched")
    text = tokenizer.encode(TEXT)
    for width in (1, 2, 3, 4):
        gaps = []
        for start in range(args.prompts):
            prompt = text[start : start + width]
            sample = engine.generate([prompt], SamplingParams(max_new_tokens=2, n=1))[0][0]
            sampled = torch.tensor(sample.logprobs, dtype=torch.float64)
            row = torch.tensor([prompt + list(sample.token_ids)])
            target = torch.zeros_like(row)
            target[0, width:] = 1
            with torch.no_grad():
                shared, _ = shared_prompt_logprobs(model, [prompt], [list(sample.token_ids)], [0], 0)
                whole, _ = token_logprobs(model, row, torch.ones_like(row), target)
            gaps.append(torch.stack([shared.double() - sampled, whole[0, width:].double() - sampled]).abs())
        gap = torch.stack(gaps)  # prompts, layout, token
        print(json.dumps({"prompt_tokens": width, "threads": torch.get_num_threads(),
                          "max_gap_by_token": [float(g) for g in gap.amax(dim=(0, 1))],
                          "beyond_1e-4": int((gap > 1e-4).sum()), "of": gap.numel()}), flush=True)


if __name__ == "__main__":
    main()
