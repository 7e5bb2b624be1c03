"""The choices a process makes from measuring its machine that decide which numbers it computes,
as one record another process can follow.

rlvr measures this CPU once and keeps the results in $RLVR_CACHE: whether "auto" means bfloat16
(rlvr.models.fast_bf16), which form runs each of the decoder's products (rlvr.rollout.plans), and
up to how many keys attention runs on float32 copies (rlvr.attention). Each choice changes the
numbers a bf16 run samples and trains with, by their rounding. A resumed run that measured again
(the cache cleared, written over by another process, or on another machine) computed other numbers
than its first invocation and went its own way from the first sample whose draw lay near a
boundary: resumed with an empty cache, every resume of a tiny bf16 run diverged at its first step
(issue 50, docs/LOG.md session 22). So a run's checkpoints keep its `Numerics`, and a resume
`follow`s them before it loads a model; rollout workers and learner ranks follow the driver's.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import torch

from rlvr import attention
from rlvr.models import bf16_supported, cpu_signature, follow_auto_dtype, resolve_dtype
from rlvr.rollout import plans
from rlvr.rollout.forms import FORMS, form_unavailable

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class Numerics:
    """What a process chose from measurements of its machine (see the module docstring)."""

    cpu: str
    """`cpu_signature()`: where the choices were measured."""
    torch: str
    threads: int
    """torch's intra-op threads (the attention limit is measured per thread count)."""
    auto_dtype: str
    """What "auto" resolves to on a CPU: "bfloat16" or "float32"."""
    attention: dict[str, float] = field(default_factory=dict)
    """Per dtype, the most keys attention runs on float32 copies (0: none; inf: every length)."""
    products: dict[str, dict[str, list[str]]] = field(default_factory=dict)
    """Per dtype and shapes, the forms of the decoder's products (`plans.used_plans`)."""

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready (an infinite limit as the string "inf")."""
        out = dataclasses.asdict(self)
        out["attention"] = {k: "inf" if math.isinf(v) else v for k, v in self.attention.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Numerics:
        known = {f.name for f in dataclasses.fields(cls)}
        data = {k: v for k, v in data.items() if k in known}
        data["attention"] = {k: float(v) for k, v in data.get("attention", {}).items()}
        return cls(**data)


def current() -> Numerics:
    """This process's choices so far: "auto"'s dtype on a CPU, the attention limits of the models
    it loaded, and the plans of the decoders it built (`plans.used_plans`)."""
    return Numerics(
        cpu=cpu_signature(), torch=torch.__version__, threads=torch.get_num_threads(),
        auto_dtype=str(resolve_dtype("auto", "cpu")).removeprefix("torch."),
        attention={str(dtype).removeprefix("torch."): keys for dtype, keys in attention.attention_limits().items()},
        products={shape: {"layers": list(p.layers), "head": list(p.head)} for shape, p in plans.used_plans().items()})


def follow(numerics: Numerics | None) -> list[str]:
    """Make this process compute the numbers ``numerics`` describe, for everything it loads and
    builds from now on: "auto"'s dtype, the attention limits and the decoder's plans; None: its
    own measurements again (a new run). Returns what differs here, said as warnings (another CPU
    or torch version, other threads, $RLVR_AUTO_DTYPE asking for another dtype, a form this CPU
    lacks); the choices that can be followed still are."""
    if numerics is None:
        follow_auto_dtype(None)
        attention.follow_attention_limits({})
        plans.follow_plans({})
        return []
    said = []
    here = cpu_signature()
    if numerics.cpu != here or numerics.torch != torch.__version__:
        said.append(f"it ran on {numerics.cpu} with torch {numerics.torch}, and this is {here} with torch "
                    f"{torch.__version__}: its numbers may differ in their last bits from here on")
    if numerics.threads != torch.get_num_threads():
        said.append(f"it ran on {numerics.threads} torch threads and this process has {torch.get_num_threads()}: "
                    "some products may sum in another order")
    auto = _DTYPES[numerics.auto_dtype]
    follow_auto_dtype(None)
    own = resolve_dtype("auto", "cpu")  # $RLVR_AUTO_DTYPE, or this machine's measurement
    if auto == torch.bfloat16 and not bf16_supported("cpu"):
        said.append('"auto" meant bfloat16 there, which this CPU does not compute natively: it stays bfloat16 (set '
                    "train.precision to change it)")
    elif own != auto:
        said.append(f'"auto" means {numerics.auto_dtype} as when it started, not '
                    f'{str(own).removeprefix("torch.")} as it would here now')
    follow_auto_dtype(auto)
    attention.follow_attention_limits({_DTYPES[k]: v for k, v in numerics.attention.items()})
    usable, lacking = {}, []
    for shape, plan in numerics.products.items():
        dtype = _DTYPES.get(shape.split("|", 1)[0].removeprefix("torch."), torch.float32)
        missing = sorted({n for n in (*plan["layers"], *plan["head"]) if n not in FORMS
                          or form_unavailable(n, dtype) is not None})
        if missing:
            lacking += missing
            continue
        usable[shape] = plans.Plans(tuple(plan["layers"]), tuple(plan["head"]))
    if lacking:
        said.append(f"this machine lacks the product forms {', '.join(sorted(set(lacking)))}: it measures its own")
    plans.follow_plans(usable)
    return said
