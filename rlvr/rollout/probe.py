"""After every weight sync, a check that the engine computes what the learner computes.

An engine that holds its own copy of the policy (vLLM, in its own processes; a Ray rollout
worker's) is told the new weights after every update, by parameter name. A sync that loads
nothing, loads some parameters under the wrong names, or loads stale weights (a LoRA adapter
left unmerged) would not fail: the engine would go on sampling an older or another policy, and
the importance ratios would quietly absorb it. So after each sync the engine scores a fixed
sequence (`PROBE_TEXT`: the log-probability of each of its tokens given those before) and the
learner scores it as it scores tokens for its loss (rlvr.train.updater.learner_probe), the
adapter applied as the learner applies it, not the merged weights that were sent; the two must agree to the rounding of their dtypes
(`tolerance`), or the run stops with `WeightSyncError`.

An engine offers this as ``probe(ids) -> list[list[float]]``: for each replica it runs (one, or
one per rollout worker), the log-probs of ``ids[1:]``, at temperature 1 and without top-k, top-p
or banned tokens. Engines without it (the embedded engine, which shares the learner's weights or
copies them in-process) are not probed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rlvr.errors import WeightSyncError

PROBE_TEXT = "Probe of the weights: 17 + 25 = 42, and the quick brown fox jumps over the lazy dog."
PROBE_TOKENS = 24
"""At most this many tokens of `PROBE_TEXT` are scored: enough that a changed weight shows in
the mean, few enough that the probe costs a prefill of one short prompt a step."""


def probe_ids(tokenizer: Any) -> list[int]:
    return list(tokenizer.encode(PROBE_TEXT, add_special_tokens=False))[:PROBE_TOKENS]


def tolerance(*dtypes: torch.dtype) -> float:
    """The largest mean |Δ log-prob| (nats a token) two computations of the same weights may show.

    Both in fp32: they differ only in the order of their sums (relative ~1e-6 on logits of a few
    units: ~1e-5 nats), so 1e-3 leaves a margin of 100. A 16-bit side rounds every stored value
    to 8 (bf16) or 11 (fp16) bits: the bundled model's bf16 engine differs from its fp32 learner
    by ~0.04 nats a sampled token on average (docs/performance.md), more on unlikely tokens, so
    0.25. A weight change smaller than this does not show in a 16-bit engine, nor could it
    change what the engine samples by more than its rounding does."""
    return 1e-3 if all(d in (torch.float32, torch.float64) for d in dtypes) else 0.25


def check(engine: Sequence[Sequence[float]], learner: Sequence[float], tol: float, version: int | None = None) -> float:
    """The largest mean |Δ| over the replicas; `WeightSyncError` where one exceeds ``tol``."""
    worst = 0.0
    for k, replica in enumerate(engine):
        if len(replica) != len(learner):
            raise WeightSyncError(f"the engine's probe scored {len(replica)} tokens, the learner {len(learner)}")
        gap = sum(abs(a - b) for a, b in zip(replica, learner)) / max(len(learner), 1)
        if gap > tol:
            where = f"replica {k} of the engine" if len(engine) > 1 else "the engine"
            after = f" after update {version}" if version is not None else " after the weight update"
            raise WeightSyncError(
                f"{where} computes other log-probabilities than the learner{after}: mean |Δ| = {gap:.4g} nats a "
                f"token over the probe's {len(learner)} tokens, above the {tol:g} its dtypes allow "
                f"(rlvr.rollout.probe). The new weights did not all reach it (a name it does not know, an "
                f"adapter not merged); it would sample from a policy the learner no longer has")
        worst = max(worst, gap)
    return worst
