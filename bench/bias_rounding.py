"""Where a projection's bias is added, and whether it shows in bf16: `nn.Linear`'s `F.linear(x, w, b)`
(the learner's q/k/v in Qwen2) against the product rounded first and the bias added after, and
against the decoder's forms that take the bias inside the kernel (rlvr.rollout.forms).

    python bench/bias_rounding.py

Prints, per width and row count, the share of outputs whose bits differ from the learner's.
Findings: docs/LOG.md (session 39)."""

from __future__ import annotations

import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from rlvr.rollout.forms import FORMS


def main() -> None:
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    for width, outs in ((576, (576, 192, 192)), (896, (896, 128, 128))):  # SmolLM2-135M, Qwen2.5-0.5B
        ws = [(torch.randn(o, width) * 0.05).to(bf16) for o in outs]
        bs = [(torch.randn(o) * 0.5).to(bf16) for o in outs]
        weight, bias = torch.cat(ws), torch.cat(bs)
        x = torch.randn(1, 300, width).to(bf16)
        learner = torch.cat([F.linear(x, w, b) for w, b in zip(ws, bs)], -1)[0]  # 3-D, as the model runs it
        def after(r: torch.Tensor) -> torch.Tensor:
            return F.linear(r, weight) + bias

        def inside(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
            run, kept = FORMS[name].run, FORMS[name].prepare(weight)
            return lambda r: run(kept, r, bias)

        products = {"added after rounding": after} | {name: inside(name) for name in ("linear", "onednn", "xw")}
        for name, product in products.items():
            differing = {}
            for rows in (1, 2, 3, 4, 8, 16, 64):
                y = torch.cat([product(x[0, i : i + rows]) for i in range(0, 256, rows)])
                differing[rows] = round((y != learner[: len(y)]).float().mean().item(), 4)
            print(json.dumps({"width": width, "product": name, "share_differing_by_rows": differing}), flush=True)


if __name__ == "__main__":
    main()
