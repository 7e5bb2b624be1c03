"""How far a row's sampling policy is from the learner's, to choose OPSM's δ (the paper gives none).

    python bench/opsm_drift.py [SEED] [overrides...]

Trains 4 demo steps with float16 decoding and OPSM at δ = 1e9 (it drops nothing, so this is
float16 decoding as it is), recording every row's drift, mean_t log(μ/π_θ), and mean advantage
as OPSM sees them. Prints the drift's quantiles and, for several δ, the fraction of rows OPSM
would drop (negative advantage and drift > δ)."""

from __future__ import annotations

import sys
import tempfile

import torch

from rlvr.algos import offpolicy
from rlvr.algos.inputs import LossInputs
from rlvr.config import load_config
from rlvr.train import update
from rlvr.train.loop import train

rows: list[tuple[float, float]] = []


def recording(x: LossInputs, **kw: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    m = x.mask.bool()
    n = m.sum(-1).clamp(min=1)
    drift = torch.where(m, x.need("sampler") - x.logprobs.detach(), 0.0).sum(-1) / n
    adv = torch.where(m, x.advantages, 0.0).sum(-1) / n
    rows.extend((d, a) for d, a, k in zip(drift.tolist(), adv.tolist(), m.sum(-1).tolist()) if k)
    return offpolicy.offpolicy_sequence_mask(x, **kw)


def main() -> None:
    seed = sys.argv[1] if len(sys.argv) > 1 else "0"
    update.CORRECTIONS["opsm"] = recording  # the update looks the correction up at each step
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config("configs/demo.toml", (f"seed={seed}", 'engine.dtype="float16"', 'algo.offpolicy="opsm"',
                                                "algo.offpolicy_kwargs={delta = 1e9}", "train.steps=4",
                                                f"output_dir={out}", "name=drift", *sys.argv[2:]))
        train(cfg, quiet=True)
    drifts = sorted(d for d, _ in rows)
    q = [drifts[min(len(drifts) - 1, int(p * len(drifts)))] for p in (0.1, 0.5, 0.9, 0.95, 0.99)]
    print(f"{len(drifts)} rows; drift quantiles 10/50/90/95/99%: " + ", ".join(f"{v:.5f}" for v in q))
    for delta in (0.0, 1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2):
        dropped = sum(1 for d, a in rows if a < 0 and d > delta) / len(rows)
        print(f"delta {delta:g}: OPSM drops {dropped:.1%} of the rows")


if __name__ == "__main__":
    main()
