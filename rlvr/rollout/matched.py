"""Matched numerics: the embedded engine computes a bf16 model's numbers bit for bit as
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
  matches one row, a single row runs as two (the "paired" forms, rlvr.rollout.forms). The probe
  runs on inputs made to show a sum's order (`revealing`): on random ones, a kernel that sums in
  another order differs only where a result lies near a bf16 rounding boundary, rarely enough to
  pass a probe by luck, as the tiny test model's 32-wide products did;
- q/k/v biases (Qwen2) added inside the product, to its float32 sums, as `nn.Linear` adds them
  (rlvr.rollout.forms): added to the rounded product, 30% of the outputs differed in a bit;
- everything else the two sides already share: the model's own norm, rotary and activation
  modules (elementwise or per-row), and a log-softmax of the same float32 logits.

What is left is the final log-softmax (the sampler's `log_softmax` against the learner's
`logsumexp`, both in float32): ~1e-6 nats. Measured on the bundled model (bf16, AMD EPYC Zen 5):
mean |engine - learner| 7e-6 nats, no token outside the band, against 0.034 and 8.3% before.

The cost: float64 attention (its keys and values, 4 times bf16's bytes, in the decoder's buffers)
and no float16 copies at one row: docs/performance.md has the engine's and the learner's speed.

Not matched: attention dropout, remote-code models, and a bias on only some of q/k/v. Forwards of
1-3 tokens (a 2-token completion alone in its micro-batch, a 1-token prompt alone in its prefill)
are padded to `FEWEST_ROWS` on both sides, where so few rows could round otherwise
(rlvr.models.product_width). The KL reference model runs the policy's float64 attention too
(rlvr.train.methods.kl), and after torch's thread count changes the engine probes again
(`EmbeddedEngine._rematch`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from rlvr.attention import is_sdpa
from rlvr.models import FEWEST_ROWS
from rlvr.rollout.forms import (QKV, FORMS, ROWS, Plan, form_unavailable, fused_bias, fused_parts, joined,
                                partial_qkv_bias)
from rlvr.rollout.plans import Plans, product_plans
from rlvr.rollout.static_decode import unsupported_reason

log = logging.getLogger(__name__)

LEARNER_ROWS = (FEWEST_ROWS, 7, 100, 400)
"""Row counts at which the learner's own product is checked against its product of `PROBE_ROWS`
rows (it runs micro-batches of any size, and the engine's prefill a prompt batch of any size).
Neither runs its layers on fewer than `FEWEST_ROWS` tokens (rlvr.models.product_width pads such
a forward), where so few rows may round otherwise (oneDNN's 1536→576 bf16 product at one row, and
the tiny test model's 32-wide products at 1-3 rows, on a Zen 5 EPYC). The output head does run
1-3 rows (a prefill's last token, a chunk's last scored tokens): `_probe` checks it there."""
PROBE_ROWS = 512
"""Rows of the probe's input: the learner's product of these many rows is the reference."""
SLICES, CHECKED_ROWS = 16, 64
"""A row count is checked on up to `SLICES` different slices of the input, `CHECKED_ROWS` rows in
all (at least two slices): on `revealing` inputs a kernel that sums in another order differs in
most rows, so it cannot pass by luck."""
EVERY_COUNT = 16
"""Up to this many rows the probe checks every row count (a kernel blocked by 4, 8 or 16 rows
shows there); beyond it each bucket's least and most."""
CANDIDATES = ("onednn", "linear", "xw", "left", "mkl", "onednn_paired", "linear_paired")
"""The forms tried, in this order after the speed plan's own, for a row count where that one
does not match; the paired ones (`forms._paired`) run a single row as two."""
_CHOSEN: dict[str, Plans | str] = {}
"""Per `_key`, the probe's plans or why there are none."""
_OWN: dict[str, str | None] = {}
"""Per `_key`, `own_products_differ`'s answer."""


def unmatched_reason(model: PreTrainedModel) -> str | None:
    """Why matched numerics cannot run `model` (or None where they can, `matched_plans` aside)."""
    dtype = model.dtype
    if dtype != torch.bfloat16:
        return (f"the model is {str(dtype).removeprefix('torch.')}: matching is for bfloat16 models (fp32 already "
                "agrees to ~1e-5; float16's range cannot hold the probe's `revealing` inputs)")
    if any(p.device.type != "cpu" for p in model.parameters()):
        return "the model is not on a CPU (a GPU's products are not checked to be row-invariant)"
    if not is_sdpa(model) or not type(model).__module__.startswith("transformers."):
        return (f"the model's attention is {model.config._attn_implementation!r} in {type(model).__module__}, not "
                "SDPA in a model class of transformers' own (remote code may call attention itself)")
    if getattr(model.config, "attention_dropout", 0.0):
        return "attention dropout is on (the float64 forward and its float32 backward would drop other weights)"
    if getattr(model.config, "vision_config", None) is not None:
        return "a vision-language model's image encoder is not matched"
    layers = getattr(getattr(model, "model", None), "layers", None)
    attn = getattr(layers[0], "self_attn", None) if layers else None
    if attn is None or any(not hasattr(attn, name) for name in QKV):
        return "the model's layers are not where the probe looks for them (model.layers[i].self_attn.q_proj, ...)"
    if partial_qkv_bias(model):
        return "only some of the query/key/value projections have a bias, and the probe checks them fused"
    return None


def matched_plans(model: PreTrainedModel) -> Plans | str:
    """Plans for `FusedWeights` whose every form gives the learner's bits at its row counts, or a
    string saying why there are none: the learner's own product is not row-invariant here, or no
    form matches it at some row count. Probed once per process for each dtype, set of shapes and
    thread count (~0.8 s for the bundled model, on its first layer and output head); not cached
    on disk, since it is what makes the numbers right."""
    why = unmatched_reason(model)
    if why is not None:
        return why
    key = _key(model)
    if key not in _CHOSEN:
        _CHOSEN[key] = _probe(model)
        if isinstance(_CHOSEN[key], str):
            log.warning("matched numerics are not available here: %s", _CHOSEN[key])
    return _CHOSEN[key]


def chosen_decoder(model: PreTrainedModel, decoder: str) -> str:
    """The decoder an engine's ``decoder`` setting runs `model` with: "static" where asked, or
    where "auto" and the static decoder can run it; else "hf"."""
    return "static" if decoder == "static" or (decoder == "auto" and unsupported_reason(model) is None) else "hf"


def engine_matched_plans(model: PreTrainedModel, decoder: str, weights: str) -> Plans | str:
    """The product plans a matched engine runs `model` on (`matched_plans`), or why it cannot:
    copies of the weights in another format; or the Hugging Face decoder where a single row's
    product rounds otherwise on this CPU (its steps run the model's own products, which cannot
    run one row as two)."""
    if weights != "model":
        return f"engine.dtype = {weights!r} decodes on copies of the weights in another format"
    plans = matched_plans(model)
    if isinstance(plans, str):
        return plans
    if chosen_decoder(model, decoder) == "hf" and (why := own_products_differ(model)):
        return (f"{why}, and the Hugging Face decoder's steps run the model's own products at every count of "
                "running rows (the static decoder runs its products in checked forms)")
    return plans


def revealing(rows: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Inputs whose products' sums show the order they were summed in: small integers, with one
    +2^24 and one -2^24 in each row. Against weights of ±1, a column where the two cancel sums to a
    small integer, but only the small terms added while the partial sum was not near ±2^24 survive
    (float32 keeps 24 bits), so another order of the sum gives another small integer, which bf16
    shows. On random normal inputs a kernel that sums in another order differs only where a result
    falls near a bf16 rounding boundary: ~20 of 1.3 million outputs for the tiny test model's
    32-wide products, which a probe of random rows passed by luck; on these, 75-100% of the rows
    differ (and a kernel that sums in the same order, none)."""
    x = torch.randint(-3, 4, (rows, width), generator=gen).float()
    at = torch.arange(rows)
    plus = torch.randint(0, width, (rows,), generator=gen)
    minus = (plus + 1 + torch.randint(0, width - 1, (rows,), generator=gen)) % width
    x[at, plus], x[at, minus] = 2.0**24, -(2.0**24)
    return x


def _signs(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    """Weights of ±1 in `shape`: 256 random rows, repeated (a kernel's order of summation depends on
    the shapes, not on the values; an output head's 49,152 random rows took a third of a second)."""
    block = torch.randint(0, 2, (min(256, shape[0]), shape[1]), generator=gen).float() * 2 - 1
    return block.repeat(-(-shape[0] // len(block)), 1)[: shape[0]]


def _key(model: PreTrainedModel) -> str:
    """What the probe's answer depends on: the dtype, the shapes and torch's thread count now."""
    head = model.lm_head.weight
    layer_shapes = ",".join("x".join(map(str, p.shape)) for p in model.model.layers[0].parameters())
    return f"{head.dtype}|{layer_shapes}|{'x'.join(map(str, head.shape))}|{torch.get_num_threads()} threads"


class _Case:
    """One product the learner runs, in the shapes of its weights (several where the decoder joins
    them) but on numbers made to show the order of its sums: weights of ±1, and inputs of
    `revealing` rows; the learner's product of all `PROBE_ROWS` rows is the reference.

    With ``bias`` (q/k/v in Qwen2), biases of the products' own size (±1 weights on unit inputs
    sum to ~√width), and normal inputs too: where a bias is added shows only on sums that are not
    small integers, and on normal ones adding it to the rounded product changed 30% of outputs."""

    def __init__(self, parts: list[torch.Tensor], gen: torch.Generator, head: bool = False, bias: bool = False) -> None:
        width, dtype = parts[0].shape[1], parts[0].dtype
        self.parts = [_signs(w.shape, gen).to(w.dtype) for w in parts]
        self.weight = joined(self.parts)
        self.biases = [(torch.randn(w.shape[0], generator=gen) * width**0.5).to(dtype) if bias else None for w in parts]
        self.bias = torch.cat(self.biases) if bias else None  # type: ignore[arg-type]
        self.inputs = [revealing(PROBE_ROWS, width, gen).to(dtype)]
        if bias:
            self.inputs.append(torch.randn(PROBE_ROWS, width, generator=gen).to(dtype))
        self.head = head
        self.refs = [self.learner(x) for x in self.inputs]

    def learner(self, x: torch.Tensor) -> torch.Tensor:
        """The learner's product of `x`: nn.Linear, one projection each; the head's as
        rlvr.train.logprobs._HeadLogprobs takes it."""
        if self.head:
            return x @ self.weight.T
        return torch.cat([F.linear(x, w, b) for w, b in zip(self.parts, self.biases)], -1)

    def agrees(self, product: Callable[[torch.Tensor], torch.Tensor], rows: int) -> bool:
        """Whether `product` of `rows` rows gives the reference's bits on `SLICES` slices of each input."""
        slices = max(2, min(SLICES, CHECKED_ROWS // rows))
        starts = range(0, min(slices * rows, PROBE_ROWS - rows + 1), rows)
        return all(torch.equal(product(x[i : i + rows]), ref[i : i + rows])
                   for x, ref in zip(self.inputs, self.refs) for i in starts)

    def shape(self) -> str:
        return f"{self.weight.shape[1]}→{self.weight.shape[0]}"


def _layer_cases(model: PreTrainedModel, gen: torch.Generator) -> list[_Case]:
    """The products of the model's first layer, as the decoder joins them (`fused_parts`)."""
    layer = model.model.layers[0]
    has_bias = (fused_bias(layer) is not None, False, False, False)
    return [_Case(parts, gen, bias=b) for parts, b in zip(fused_parts(layer), has_bias)]


def _probe(model: PreTrainedModel) -> Plans | str:
    speed = product_plans(model)
    gen = torch.Generator().manual_seed(0)
    layers = _layer_cases(model, gen)
    head = _Case([model.lm_head.weight.detach()], gen, head=True)
    # the head runs fewer than FEWEST_ROWS rows unpadded: the prefill's (one row a prompt), a learner
    # chunk's last few scored tokens
    for rows in range(1, FEWEST_ROWS):
        if not head.agrees(lambda x: F.linear(x, head.weight), rows):
            return (f"the model's output head gives other bits at {rows} rows than the learner's product of "
                    "many rows' hidden states")
    layer_plan, head_plan = _plan(layers, speed.layers), _plan([head], speed.head)
    for plan in (layer_plan, head_plan):
        if isinstance(plan, str):
            return plan
    return Plans(layer_plan, head_plan)  # type: ignore[arg-type]


def bucket_counts(bucket: int) -> list[int]:
    """The row counts the probe checks for bucket `bucket` of `ROWS`: every count it runs up to
    `EVERY_COUNT`, and beyond that the least and the most (and 200 for the last bucket, which
    runs any count above 32)."""
    low, high = (ROWS[bucket - 1] + 1 if bucket else 1), ROWS[bucket]
    counts = set(range(low, high + 1)) if high <= EVERY_COUNT else {low, high}
    return sorted(counts | ({200} if bucket == len(ROWS) - 1 else set()))


def own_products_differ(model: PreTrainedModel) -> str | None:
    """Why the model's own products (the learner's: one `F.linear` a projection) give some row
    count other bits than many rows, or None: the Hugging Face decoder's steps run them at every
    count of running rows. Probed once per process, as `matched_plans`."""
    key = _key(model)
    if key not in _OWN:
        gen = torch.Generator().manual_seed(0)
        cases = _layer_cases(model, gen)
        cases.append(_Case([model.lm_head.weight.detach()], gen, head=True))

        def own(case: _Case) -> Callable[[torch.Tensor], torch.Tensor]:  # the HF decoder's head is nn.Linear
            return (lambda x: F.linear(x, case.weight)) if case.head else case.learner

        _OWN[key] = next((f"the model's own {case.shape()} product rounds {rows} rows otherwise than the learner's"
                          for b in range(len(ROWS)) for rows in bucket_counts(b) for case in cases
                          if not case.agrees(own(case), rows)), None)
    return _OWN[key]


def _plan(cases: list[_Case], speed: Plan) -> Plan | str:
    """Per bucket of `ROWS`, the first form (the speed plan's own, then `CANDIDATES`) whose product
    of that many rows equals the learner's in every case bit for bit; or why there is none."""
    for case in cases:
        for rows in LEARNER_ROWS:
            if not case.agrees(case.learner, rows):
                return (f"the learner's own {case.shape()} product gives other bits at {rows} rows than at "
                        f"{PROBE_ROWS}: its kernel is not row-invariant on this CPU")
    kept: dict[tuple[str, int], object] = {}
    usable = {name: not FORMS[name].in_fp16 and form_unavailable(name, cases[0].weight.dtype) is None
              for name in dict.fromkeys((*speed, *CANDIDATES))}

    def matches(name: str, bucket: int) -> bool:
        form = FORMS[name]
        if not usable[name]:
            return False
        counts = bucket_counts(bucket)
        for i, case in enumerate(cases):
            if (name, i) not in kept:
                kept[name, i] = form.prepare(case.weight)
            if not all(case.agrees(lambda x: form.run(kept[name, i], x, case.bias), rows) for rows in counts):
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
