"""Matched numerics: the embedded engine computes a bf16 (or float16) model's numbers bit for bit as
the learner does, so the log-probs it samples with are the learner's own.

Why: in bf16 the learner runs each sequence whole and the decoder one token at a time, and the two
shapes round differently. On the bundled model the engine's sampled log-probs then differed from
the learner's by a mean |log ratio| of 0.034 nats, 8% of tokens outside a [0.9, 1.1] ratio band
(fp32: 9e-6): off-policy data that the loss treats as on-policy. Where the two sides first
differed (bench/drift_ops.py): attention, whose kernel sums the keys in an order that depends on
how many queries it runs and how many keys it sees; and, in the decoder's fastest forms, the
products (a float16 copy of the weights at one row). Once one bit differs, the difference grows
through the layers; rounding the logits less does not help (bench/drift_budget.py, docs/LOG.md
session 37).

What matching takes, each checked here rather than assumed:
- attention in float64 on both sides (`rlvr.attention.exact_sdpa`: the learner's forward and the
  engine's prefill; `StaticDecoder(exact=True)`: the decode steps), rounded once to the model's
  dtype. A float64 sum's rounding error (~1e-16 of the sum) moves a bf16 result (~4e-3 between
  neighbours) to another value with a probability of about 1e-13 per output, so the order the
  keys are summed in no longer shows;
- products whose kernel gives each row the same bits whatever the row count. oneDNN's bf16 product
  does from two rows on (`F.linear` of 2 to 1,024 rows, the packed form too, on a Zen 5 EPYC), and
  at one row for some shapes only (its 1536→576 product rounded 13% of single rows otherwise). So
  every form the decoder runs is probed here against the learner's own product at many row
  counts (`matched_plans`), a form that differs at some count is not used there, and where none
  matches one row, a single row runs as two (the "paired" forms, rlvr.rollout.forms);
- everything else the two sides already share: the model's own norm, rotary and activation
  modules (elementwise or per-row), and a log-softmax of the same float32 logits.

What is left is the final log-softmax (the sampler's `log_softmax` against the learner's
`logsumexp`, both in float32): ~1e-6 nats. Measured on the bundled model (bf16, AMD EPYC Zen 5):
mean |engine - learner| 7e-6 nats, no token outside the band, against 0.034 and 8.3% before.

The cost: float64 attention (its keys and values, 4 times bf16's bytes, in the decoder's buffers)
and no float16 copies at one row: docs/performance.md has the engine's and the learner's speed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from rlvr.attention import is_sdpa
from rlvr.rollout.forms import FORMS, ROWS, Plan, form_unavailable, fused_parts, joined
from rlvr.rollout.plans import Plans, product_plans

log = logging.getLogger(__name__)

LEARNER_ROWS = (2, 3, 100, 400)
"""Row counts at which the learner's own product is checked against its product of `PROBE_ROWS`
rows (it runs micro-batches of any size, and the engine's prefill a prompt batch of any size; a
forward of a single token, which neither runs in practice, is not covered)."""
PROBE_ROWS = 512
"""Rows of the probe's input: the learner's product of these many rows is the reference."""
SLICES, CHECKED_ROWS = 64, 128
"""A row count is checked on up to `SLICES` different slices of the input, `CHECKED_ROWS` rows in
all (at least two slices): a kernel that rounds one row in eight differently must not pass by
luck (64 single rows: it would pass once in 5,000)."""
CANDIDATES = ("onednn", "linear", "xw", "left", "mkl", "onednn_paired", "linear_paired")
"""The forms tried, in this order after the speed plan's own, for a row count where that one
does not match; the paired ones (`forms._paired`) run a single row as two."""
_CHOSEN: dict[str, Plans | str] = {}


def unmatched_reason(model: PreTrainedModel) -> str | None:
    """Why matched numerics cannot run `model` (or None where they can, `matched_plans` aside)."""
    dtype = model.dtype
    if dtype not in (torch.bfloat16, torch.float16):
        return f"the model is {str(dtype).removeprefix('torch.')}: matching is for 16-bit models (fp32 already agrees to ~1e-5)"
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the model is not on a CPU (a GPU's products are not checked to be row-invariant)"
    if not is_sdpa(model):
        return f"the model's attention is {model.config._attn_implementation!r}, not SDPA"
    if getattr(model.config, "vision_config", None) is not None:
        return "a vision-language model's image encoder is not matched"
    return None


def matched_plans(model: PreTrainedModel) -> Plans | str:
    """Plans for `FusedWeights` whose every form gives the learner's bits at its row counts, or a
    string saying why there are none: the learner's own product is not row-invariant here, or no
    form matches it at some row count. Probed once per process for each dtype, set of shapes and
    thread count (~1.5 s for the bundled model, on its first layer and output head); not cached
    on disk, since it is what makes the numbers right."""
    why = unmatched_reason(model)
    if why is not None:
        return why
    head = model.lm_head.weight.detach()
    layer_shapes = ",".join("x".join(map(str, p.shape)) for p in model.model.layers[0].parameters())
    key = f"{head.dtype}|{layer_shapes}|{'x'.join(map(str, head.shape))}|{torch.get_num_threads()} threads"
    if key not in _CHOSEN:
        _CHOSEN[key] = _probe(model)
        if isinstance(_CHOSEN[key], str):
            log.warning("matched numerics are not available here: %s", _CHOSEN[key])
    return _CHOSEN[key]


class _Case:
    """One product the learner runs: its weights (several where the decoder joins them), an input
    of `PROBE_ROWS` rows, and the learner's product of the first rows of it."""

    def __init__(self, parts: list[torch.Tensor], gen: torch.Generator, head: bool = False) -> None:
        self.parts, self.weight = parts, joined(parts)
        self.x = torch.randn(PROBE_ROWS, parts[0].shape[1], generator=gen).to(parts[0].dtype)
        self.head = head
        self.ref = self.learner(self.x)

    def learner(self, x: torch.Tensor) -> torch.Tensor:
        """The learner's product of `x`: nn.Linear, one projection each; the head's as
        rlvr.train.logprobs._HeadLogprobs takes it."""
        return x @ self.weight.T if self.head else torch.cat([F.linear(x, w) for w in self.parts], -1)

    def agrees(self, product: Callable[[torch.Tensor], torch.Tensor], rows: int) -> bool:
        """Whether `product` of `rows` rows gives the reference's bits on `SLICES` slices of the input."""
        slices = max(2, min(SLICES, CHECKED_ROWS // rows))
        starts = range(0, min(slices * rows, PROBE_ROWS - rows + 1), rows)
        return all(torch.equal(product(self.x[i : i + rows]), self.ref[i : i + rows]) for i in starts)

    def shape(self) -> str:
        return f"{self.weight.shape[1]}→{self.weight.shape[0]}"


def _probe(model: PreTrainedModel) -> Plans | str:
    speed = product_plans(model)
    gen = torch.Generator().manual_seed(0)
    layers = [_Case(parts, gen) for parts in fused_parts(model.model.layers[0])]
    head = _Case([model.lm_head.weight.detach()], gen, head=True)
    for rows in (1, 3):  # the prefill's head: the first sampled token's logits, of one prompt or a few
        if not head.agrees(lambda x: F.linear(x, head.weight), rows):
            return (f"the model's output head gives other bits at {rows} rows than the learner's product of "
                    "many rows' hidden states")
    layer_plan, head_plan = _plan(layers, speed.layers), _plan([head], speed.head)
    for plan in (layer_plan, head_plan):
        if isinstance(plan, str):
            return plan
    return Plans(layer_plan, head_plan)  # type: ignore[arg-type]


def _plan(cases: list[_Case], speed: Plan) -> Plan | str:
    """Per bucket of `ROWS`, the first form (the speed plan's own, then `CANDIDATES`) whose product
    of that many rows equals the learner's in every case bit for bit; or why there is none."""
    for case in cases:
        for rows in LEARNER_ROWS:
            if not case.agrees(case.learner, rows):
                return (f"the learner's own {case.shape()} product gives other bits at {rows} rows than at "
                        f"{PROBE_ROWS}: its kernel is not row-invariant on this CPU")
    kept: dict[tuple[str, int], object] = {}

    def matches(name: str, bucket: int) -> bool:
        form = FORMS[name]
        if form.in_fp16 or form_unavailable(name, cases[0].weight.dtype) is not None:
            return False
        # the bucket's own count, the least it runs, and for the last bucket a count beyond it
        counts = sorted({ROWS[bucket], ROWS[bucket - 1] + 1 if bucket else 1, *((200,) if bucket == len(ROWS) - 1 else ())})
        for i, case in enumerate(cases):
            if (name, i) not in kept:
                kept[name, i] = form.prepare(case.weight)
            if not all(case.agrees(lambda x: form.run(kept[name, i], x), rows) for rows in counts):
                return False
        return True

    plan = []
    for b, rows in enumerate(ROWS):
        name = next((n for n in dict.fromkeys((speed[b], *CANDIDATES)) if matches(n, b)), None)
        if name is None:
            shapes = ", ".join(case.shape() for case in cases)
            return f"no product form gives the learner's bits at {rows} rows for the {shapes} products"
        plan.append(name)
    return tuple(plan)
