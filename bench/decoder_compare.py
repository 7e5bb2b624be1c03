"""The engine's two decoders side by side in one process, with minor page faults per call.

    python bench/decoder_compare.py 64 static,hf,static,hf [malloc]

Argument 1: batch (= prompts × 8 samples); 2: the decoders to time, in order; "malloc" applies
rlvr.runtime.keep_freed_memory() first. Every row runs 64 new tokens (no EOS).
"""

from __future__ import annotations

import resource
import sys
import time

import rlvr.runtime
from rlvr.bench import MODEL, prompt_ids
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.types import SamplingParams


def main() -> None:
    if "malloc" in sys.argv:
        print("malloc tuning applied:", rlvr.runtime.keep_freed_memory())
    batch, decoders = int(sys.argv[1]), sys.argv[2].split(",")
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, "auto")
    ids = prompt_ids(tokenizer, batch // 8)
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch)
    engine.generate(ids[:1], SamplingParams(max_new_tokens=2, n=1))  # warm-up
    for decoder in decoders:
        engine.decoder = decoder
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        engine.generate(ids, SamplingParams(max_new_tokens=64, n=8))
        seconds = time.perf_counter() - start
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"{decoder}: {batch * 64 / seconds:.1f} tok/s, {faults} minor page faults", flush=True)


if __name__ == "__main__":
    main()
