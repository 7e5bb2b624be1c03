"""Where a bf16 learner and a bf16 decoder round differently: every module's output at each position,
from one forward pass over a whole sequence (the learner's shape) and from the same model decoding
it a token at a time with its key/value cache (a decoder's shape), compared module by module.

    python bench/drift_ops.py [--dtype bfloat16] [--tokens 48]

For each module kind (q_proj, k_proj, ..., input_layernorm, the decoder layer's output, the final
norm, lm_head) it prints the mean relative difference between the two passes at the first layer
and at the last, and the mean |difference| of the log-probabilities of the sequence's own tokens.
The module whose relative difference jumps from ~0 (the same numbers) is where the two shapes
round differently."""

from __future__ import annotations

import argparse
import collections
from typing import Any

import torch

from rlvr.bench import INSTRUCTION, MODEL, TASK
from rlvr.data import reasoning_gym_examples, render_prompt
from rlvr.models import load_model, load_tokenizer


def record(model: Any) -> tuple[dict[str, list[torch.Tensor]], list[Any]]:
    outputs: dict[str, list[torch.Tensor]] = collections.defaultdict(list)
    handles = []
    for name, module in model.named_modules():
        if not name or name == "model" or name.endswith(("layers", "rotary_emb", "act_fn")):
            continue

        def hook(mod: Any, args: Any, out: Any, name: str = name) -> None:
            t = out[0] if isinstance(out, tuple) else out
            if isinstance(t, torch.Tensor):
                outputs[name].append(t.detach().float().clone())
        handles.append(module.register_forward_hook(hook))
    return outputs, handles


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--attn", default=None, help="attention implementation to set (sdpa, eager)")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(MODEL)
    model = load_model(MODEL, args.dtype).eval()
    if args.attn:
        model.set_attn_implementation(args.attn)
    print("attention:", model.config._attn_implementation)
    example = reasoning_gym_examples("chain_sum", size=1, seed=0, params=TASK, instruction=INSTRUCTION)[0]
    prompt = render_prompt(tokenizer, example.prompt)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=args.tokens, top_k=0,
                             pad_token_id=tokenizer.pad_token_id)[0].tolist()
    n = len(prompt)
    full, handles = record(model)
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in handles:
        h.remove()
    step, handles = record(model)
    with torch.no_grad():
        out = model(torch.tensor([ids[:n]]), use_cache=True)
        cache = out.past_key_values
        for t in range(n, len(ids)):
            out = model(torch.tensor([[ids[t]]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
    for h in handles:
        h.remove()
    rows: dict[str, list[tuple[int, float]]] = collections.defaultdict(list)
    for name, calls in full.items():
        whole = calls[0][0]  # [T, ...] of the one full pass
        decoded = torch.cat([c[0] for c in step[name][1:]], 0)  # one position per decode call, after the prompt's
        ref = whole[n : len(ids)]
        ref, decoded = ref.reshape(len(ref), -1), decoded.reshape(len(decoded), -1)
        rel = ((ref - decoded).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-30)).mean().item()
        kind = name.split(".")[-1] if ".layers." in name else name
        layer = int(name.split(".")[2]) if ".layers." in name else -1
        rows[kind].append((layer, rel))
    print(f"{'module':<28}{'first layer':>14}{'last layer':>14}  first layer > 1e-4")
    for kind, values in rows.items():
        if kind.isdigit():
            continue
        values.sort()
        first = next((layer for layer, rel in values if rel > 1e-4), None)
        print(f"{kind:<28}{values[0][1]:>14.2e}{values[-1][1]:>14.2e}  {first}")
    logits_full = full["lm_head"][0][0][n - 1 : len(ids) - 1].log_softmax(-1)
    logits_step = torch.cat([step["lm_head"][0][0][-1:]] + [c[0] for c in step["lm_head"][1:-1]], 0).log_softmax(-1)
    target = torch.tensor(ids[n:])
    a = logits_full.gather(-1, target[:, None]).squeeze(-1)
    b = logits_step.gather(-1, target[:, None]).squeeze(-1)
    print(f"mean |log p full - log p decoded| over {len(target)} tokens: {(a - b).abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
