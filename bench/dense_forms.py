"""The static decoder with its fp32 projections as `Dense` runs them now (one row `x @ W`, more rows
`(W xᵀ)ᵀ`, the head included) against the form before 2026-11-26 (`x @ W` on an [in, out] copy
for every row count, the model's own `nn.Linear` head), in one process, alternating, so both
sides see the same machine load. Engine tokens/s per batch size, the best of `--rounds`.

    python bench/dense_forms.py [--batch-sizes 1,2,4,8,16,32,64] [--new-tokens 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlvr.bench import MODEL, prompt_ids
from rlvr.models import cpu_description, load_model, load_tokenizer
from rlvr.rollout import static_decode
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams


def before(self: static_decode.Dense, x: torch.Tensor) -> torch.Tensor:
    return x @ self.w_io if self.w_io is not None else F.linear(x, self.w_oi)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="1,2,4,8,16,32,64")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, torch.float32)  # the fp32 forms, whatever "auto" picks
    cpu = cpu_description()
    print(f"{cpu['model']} (family {cpu['family']} model {cpu['model_id']}), {model.dtype}, "
          f"{torch.get_num_threads()} threads; tok/s, best of {args.rounds}")
    forms: dict[str, Callable[..., torch.Tensor]] = {"x@W (before)": before, "Dense (now)": static_decode.Dense.__call__}
    print("| batch | " + " | ".join(forms) + " | ratio |\n|---|---|---|---|")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        group = min(8, batch)
        ids = prompt_ids(tokenizer, max(1, batch // group))
        engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch, decoder="static")
        engine.generate(ids[:1], SamplingParams(max_new_tokens=2, n=1))  # warm-up; builds the copies
        best = dict.fromkeys(forms, 0.0)
        for round_ in range(args.rounds):
            order = list(forms) if round_ % 2 == 0 else list(reversed(forms))  # neither side always first
            for name in order:
                static_decode.Dense.__call__ = forms[name]  # type: ignore[method-assign]
                try:
                    start = time.perf_counter()
                    engine.generate(ids, SamplingParams(max_new_tokens=args.new_tokens, n=group))
                    best[name] = max(best[name], batch * args.new_tokens / (time.perf_counter() - start))
                finally:
                    static_decode.Dense.__call__ = forms["Dense (now)"]  # type: ignore[method-assign]
        old, new = best.values()
        print(f"| {batch} | {old:.1f} | {new:.1f} | {new / old:.2f} |", flush=True)


if __name__ == "__main__":
    main()
