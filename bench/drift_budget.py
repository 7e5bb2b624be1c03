"""Which of a bf16 forward pass's roundings move the bundled model's log-probabilities, and how far.

    python bench/drift_budget.py [--sequences 8] [--tokens 48]

A hand-written Llama forward (the bundled model's architecture) on the model's bf16 weights, where
each kind of intermediate can be rounded to bf16 or kept in fp32: product inputs ("in": what a bf16
matrix product reads), product outputs ("out": q, k, v, o, gate, up, down), the residual stream
("res"), the norms' outputs ("norm"), attention's scores, probabilities and output ("attn"), the
MLP's SiLU(gate)·up ("act") and the logits ("head"). The truth rounds nothing: the bf16 weights in
fp32 arithmetic. For each choice it prints the mean |log p − log p_truth| of sampled tokens and
the fraction of tokens whose ratio to the truth lies outside [0.9, 1.1]. Two implementations that
round at the same places but in different orders are about √2 times one's distance apart."""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch

from rlvr.bench import INSTRUCTION, MODEL, TASK
from rlvr.data import reasoning_gym_examples, render_prompt
from rlvr.models import load_model, load_tokenizer

KINDS = ("in", "out", "res", "norm", "attn", "act", "head")


def forward(model: Any, ids: torch.Tensor, rounded: set[str]) -> torch.Tensor:
    """Log-probs [T, V] of one sequence, rounding to bf16 the kinds in `rounded`."""
    def r(x: torch.Tensor, kind: str) -> torch.Tensor:
        return x.to(torch.bfloat16).float() if kind in rounded else x

    def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return r(r(x, "in") @ w.float().T, "out")

    cfg = model.config
    m = model.model
    heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    T = len(ids)
    h = r(m.embed_tokens.weight[ids].float(), "res")
    pos = torch.arange(T, dtype=torch.float32)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) if hasattr(cfg, "rope_theta") \
        else m.rotary_emb.inv_freq.float()
    freqs = torch.outer(pos, inv)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)
        return r(w.float() * r(y, "norm"), "norm")

    def rope(x: torch.Tensor) -> torch.Tensor:  # [heads, T, d]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return r(r(x * cos, "out") + r(rotated * sin, "out"), "out")

    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in m.layers:
        a = layer.self_attn
        x = norm(h, layer.input_layernorm.weight)
        q = rope(linear(x, a.q_proj.weight).view(T, heads, d).transpose(0, 1))
        k = rope(linear(x, a.k_proj.weight).view(T, kv, d).transpose(0, 1))
        v = linear(x, a.v_proj.weight).view(T, kv, d).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv, 0), v.repeat_interleave(heads // kv, 0)
        scores = r(r(q, "in") @ r(k, "in").transpose(-1, -2) / math.sqrt(d), "attn").masked_fill(~mask, float("-inf"))
        probs = r(scores.softmax(-1), "attn")
        out = r(r(probs, "in") @ r(v, "in"), "attn").transpose(0, 1).reshape(T, heads * d)
        h = r(h + linear(out, a.o_proj.weight), "res")
        x = norm(h, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        act = r(torch.nn.functional.silu(linear(x, mlp.gate_proj.weight)) * linear(x, mlp.up_proj.weight), "act")
        h = r(h + linear(act, mlp.down_proj.weight), "res")
    x = norm(h, m.norm.weight)
    logits = r(r(x, "in") @ model.lm_head.weight.float().T, "head")
    return logits.log_softmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = load_tokenizer(MODEL)
    model = load_model(MODEL, "bfloat16").eval()
    examples = reasoning_gym_examples("chain_sum", size=args.sequences, seed=0, params=TASK, instruction=INSTRUCTION)
    seqs = []
    with torch.no_grad():
        for ex in examples:
            prompt = render_prompt(tokenizer, ex.prompt)
            full = model.generate(torch.tensor([prompt]), do_sample=True, max_new_tokens=args.tokens, top_k=0,
                                  pad_token_id=tokenizer.pad_token_id)[0]
            seqs.append((full, len(prompt)))

        def scored(rounded: set[str]) -> torch.Tensor:
            out = []
            for full, n in seqs:
                logp = forward(model, full, rounded)
                out.append(logp[n - 1 : len(full) - 1].gather(-1, full[n:, None]).squeeze(-1))
            return torch.cat(out)

        truth = scored(set())
        hf = []
        for full, n in seqs:
            logits = model(full[None]).logits[0].float().log_softmax(-1)
            hf.append(logits[n - 1 : len(full) - 1].gather(-1, full[n:, None]).squeeze(-1))
        print(f"{len(truth)} sampled tokens; distance from the truth (bf16 weights, fp32 arithmetic):")
        rows = [("HF's own bf16 forward", torch.cat(hf))]
        choices = [set(KINDS), set(KINDS) - {"head"}, set(KINDS) - {"res"}, set(KINDS) - {"res", "head"},
                   set(KINDS) - {"res", "norm", "attn", "head"}, {"in", "out"}, {"in"}, {"in", "head"}, {"out"}, {"res"}, {"attn"}, {"head"}]
        for rounded in choices:
            rows.append(("rounded: " + ",".join(k for k in KINDS if k in rounded), scored(rounded)))
        for name, logp in rows:
            diff = logp - truth
            outside = ((diff < math.log(0.9)) | (diff > math.log(1.1))).float().mean().item()
            print(f"  {name:<48} mean |Δ| {diff.abs().mean().item():.4f}   outside [0.9, 1.1] {outside:6.1%}")


if __name__ == "__main__":
    main()
