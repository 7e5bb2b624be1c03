"""Does compiling the static decoder's step pay on this CPU? The step in fixed shapes (the form a CUDA
graph captures), or with --plain the engine's own step, run eagerly and through `torch.compile`
(Inductor), side by side, at each batch; with --dynamic compiled once for any buffer width.

    python bench/compiled_step.py [--batches 1,8,64] [--new-tokens 64] [--cpp-wrapper] [--dynamic] [--plain]

Each product is resolved to the form the decoder's plan names for the step's row count before
tracing (rlvr's `Dense` dispatch and its lazy float16 copy otherwise break the graph into one
piece per product), and the packed oneDNN and float16 products are opaque ops to Inductor (it
cannot lower a oneDNN-packed weight). So what Inductor fuses is everything between the products:
norms, rotary, attention, activations, residual adds. Prints tok/s and the first call's time
(compilation included). Findings: docs/performance.md (sessions 38 and 40)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from rlvr.bench import MODEL, grouped_prompts
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout import static_decode
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.forms import FORMS, bucket
from rlvr.rollout.weights import Dense, FusedWeights
from rlvr.types import SamplingParams


@torch.library.custom_op("rlvr_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], packed.shape[0]))


@torch.library.custom_op("rlvr_bench::half_linear", mutates_args=())
def half_linear(x: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(half.dtype), half).to(x.dtype)


@half_linear.register_fake
def _(x: torch.Tensor, half: torch.Tensor) -> torch.Tensor:
    return x.new_empty((x.shape[0], half.shape[0]))


OPAQUE = {"onednn": lambda kept, x: packed_linear(x, kept), "half": lambda kept, x: half_linear(x, kept)}


def resolved(dense: Dense, rows: int) -> Any:
    """`dense` as one plain function of its input: the form its plan names at `rows` rows."""
    name = dense.plan[bucket(rows)]
    if name in dense.lazy:  # make the lazy copy now, as the decoder would on its first one-row steps
        dense.switch.on = True
        dense._runs(name)
    kept, bias = dense.kept[name], dense.bias
    if name in OPAQUE:
        assert bias is None, "the opaque ops take no bias (the bundled model has none)"
        return lambda x: OPAQUE[name](kept, x)
    return lambda x: FORMS[name].run(kept, x, bias)


class Resolved:
    """A `FusedWeights` whose every projection is `resolved` for one row count."""

    has_lazy = in_fp16 = False

    def __init__(self, weights: FusedWeights, rows: int) -> None:
        for name in ("qkv", "o", "gate_up", "down"):
            setattr(self, name, [resolved(d, rows) for d in getattr(weights, name)])  # type: ignore[arg-type]
        self.head = resolved(weights.head, rows)  # type: ignore[arg-type]

    def fp16_at(self, *rows: int) -> bool:
        return False


def tok_s(compiled: bool, batch: int, new_tokens: int, dynamic: bool = False, plain: bool = False) -> tuple[float, float]:
    tokenizer, model = load_tokenizer(MODEL), load_model(MODEL, "auto")
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch)

    def decoder(cache: Any, mask: torch.Tensor, n: int, offsets: Any = None, new_tokens: int = 0) -> Any:
        step = static_decode.StaticDecoder(model, engine._fused_weights(), cache, mask, n, new_tokens=new_tokens,
                                           fixed_shapes=not plain)
        step.weights = Resolved(step.weights, len(step.pos_B))  # type: ignore[assignment]
        if compiled:
            if plain:
                step._layers = torch.compile(step._layers, dynamic=dynamic)  # type: ignore[method-assign]
            else:
                step._fixed_forward = torch.compile(step._fixed_forward, dynamic=dynamic)  # type: ignore[method-assign]
        return step

    engine._decoder = decoder  # type: ignore[method-assign,assignment]
    ids, group = grouped_prompts(tokenizer, batch)
    params = SamplingParams(max_new_tokens=new_tokens, n=group)
    start = time.perf_counter()
    engine.generate(ids, params)
    first = time.perf_counter() - start
    best = 0.0
    for _ in range(2):
        start = time.perf_counter()
        engine.generate(ids, params)
        best = max(best, batch * new_tokens / (time.perf_counter() - start))
    return round(best, 1), round(first, 1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cpp-wrapper", action="store_true", help="Inductor's C++ wrapper instead of its Python one")
    parser.add_argument("--plain", action="store_true", help="the plain step (attention reads the columns written so far), not fixed shapes")
    parser.add_argument("--dynamic", action="store_true", help="compile for any buffer width (one compilation, not one a shape)")
    args = parser.parse_args()
    if args.cpp_wrapper:
        import torch._inductor.config as inductor

        inductor.cpp_wrapper = True
    for batch in map(int, args.batches.split(",")):
        (eager, _), (compiled, first) = tok_s(False, batch, args.new_tokens, plain=args.plain), tok_s(True, batch, args.new_tokens, args.dynamic, args.plain)
        print(json.dumps({"batch": batch, "step": "plain" if args.plain else "fixed", "eager_tok_s": eager, "compiled_tok_s": compiled,
                          "compiled_vs_eager": round(compiled / eager, 2), "first_call_s": first}), flush=True)


if __name__ == "__main__":
    main()
