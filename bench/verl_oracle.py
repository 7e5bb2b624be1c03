"""rlvr's loss aggregation against verl's `agg_loss`, as a numeric oracle (not a test: verl is
not a dependency). Run with a Python that has verl 0.9.1 (installed --no-deps, plus the few
modules its core_algos imports; docs/algorithms.md says how) and rlvr on the path:

    PYTHONPATH=. /tmp/verlenv/bin/python bench/verl_oracle.py

Prints, per mode, the largest absolute difference over random batches with empty rows, in
float64 (so a difference is a convention, not rounding) and float32.
"""

from __future__ import annotations

import torch
import verl.trainer.ppo.core_algos as core_algos

from rlvr.algos.aggregation import AGGREGATIONS, aggregate_loss


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32):
        worst = dict.fromkeys(AGGREGATIONS, 0.0)
        for trial in range(200):
            b, t = int(torch.randint(1, 9, (1,), generator=generator)), int(torch.randint(1, 33, (1,), generator=generator))
            loss = torch.randn(b, t, generator=generator, dtype=dtype)
            lengths = torch.randint(0, t + 1, (b,), generator=generator)
            if trial % 4 == 0:
                lengths[0] = 0  # an empty row
            if int(lengths.sum()) == 0:
                continue
            mask = (torch.arange(t)[None, :] < lengths[:, None]).to(dtype)
            non_empty = int((lengths > 0).sum())
            for mode in AGGREGATIONS:
                # verl counts the non-empty sequences (global_batch_size) and normalises sum-norm
                # by loss_scale_factor; rlvr takes the same as total_seqs and max_tokens
                theirs = core_algos.agg_loss(loss, mask, mode, global_batch_size=non_empty, loss_scale_factor=t)
                ours = aggregate_loss(loss, mask, mode=mode, total_seqs=non_empty, max_tokens=t)
                worst[mode] = max(worst[mode], float((theirs - ours).abs()))
        print(dtype, {mode: f"{diff:.2e}" for mode, diff in worst.items()})


if __name__ == "__main__":
    main()
