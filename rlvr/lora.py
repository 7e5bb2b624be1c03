"""LoRA training through PEFT, for any rollout engine.

The learner trains low-rank adapters on a frozen base (Hu et al., "LoRA: Low-Rank Adaptation of
Large Language Models", arXiv:2106.09685): each wrapped linear layer computes
``W x + (alpha / r) · B A x`` with A (r × in) and B (out × r) trained, B initialised to zero.

The rollout engine never sees adapters. It holds a plain copy of the base model, and after every
update it loads the **merged** weights ``W + (alpha / r) · B A`` (`merged_state_dict`), under the
base model's own parameter names, through the same `Engine.update_weights` every engine has. So
the embedded engine's fused decoder, or vLLM, samples from exactly the adapted policy, and no
engine needs to know about PEFT. The commonest LoRA bug in RL frameworks (adapter updates that
never reach the rollout engine, which keeps sampling from the base) is ruled out by construction,
and a test checks it: after an update, the engine's log-probs change as the learner's do.

Checkpoints hold the merged model (so `rlvr eval --model <checkpoint>` and any Hugging Face tool
load it as a plain model) and the adapter in ``<checkpoint>/adapter`` (what a resumed run loads
onto the base).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.log.tracking import import_extra

ADAPTER_DIR = "adapter"

INSTALL_HINT = "pip install 'rlvr[lora]'   (PEFT)"


def _peft() -> Any:
    return import_extra("peft", f"lora.rank > 0 needs PEFT: {INSTALL_HINT}")


def is_lora(model: Any) -> bool:
    """Whether the model carries PEFT adapters."""
    return hasattr(model, "peft_config")


def causal_lm(model: Any) -> Any:
    """The Hugging Face causal LM inside a PEFT wrapper (its layers carry the adapters), or the
    model itself: what code that reaches for ``.base_model`` (the trunk) and the LM head needs."""
    return model.get_base_model() if is_lora(model) else model


def apply_lora(model: PreTrainedModel, *, rank: int, alpha: float, dropout: float = 0.0,
               targets: list[str] | str = "all-linear", adapter: str | Path | None = None) -> Any:
    """The model wrapped with trainable LoRA adapters (everything else frozen); with ``adapter``,
    the adapter weights saved in that folder are loaded (a resumed run)."""
    peft = _peft()
    if "lm_head" in targets:
        raise ValueError("lora.targets: the LM head cannot take an adapter (log-probs are computed from its weight "
                         "in chunks); adapt the layers below it")
    if adapter is not None:
        return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=True)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                             bias="none", task_type="CAUSAL_LM")
    return peft.get_peft_model(model, config)


@torch.no_grad()
def merged_state_dict(model: Any) -> dict[str, torch.Tensor]:
    """The policy's weights as a plain model's state dict: for a PEFT model, the base weights with
    every adapter merged in (W + scale · B A), under the base model's parameter names; any other
    model's own state dict. The model is not modified."""
    if not is_lora(model):
        return dict(model.state_dict())
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, torch.Tensor] = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            layer: Any = module
            weight: torch.Tensor = layer.get_base_layer().weight
            delta = sum((layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A),
                        torch.zeros_like(weight))
            merged[f"{name}.weight"] = weight + delta.to(weight.dtype)
    out = {}
    for key, value in base.state_dict().items():
        if "lora_" in key:
            continue
        plain = key.replace(".base_layer.", ".")
        out[plain] = merged.get(plain, value)
    return out


def save_merged(model: Any, path: Path) -> None:
    """Save the policy to ``path``: a PEFT model as its merged plain model, with its adapter in
    ``path / ADAPTER_DIR``; any other model as itself."""
    if not is_lora(model):
        model.save_pretrained(path)
        return
    model.save_pretrained(path / ADAPTER_DIR)
    plain = copy.deepcopy(model.get_base_model())
    for name, module in list(plain.named_modules()):  # drop the adapter layers: plain linears again
        if hasattr(module, "base_layer"):
            parent, _, child = name.rpartition(".")
            setattr(plain.get_submodule(parent) if parent else plain, child, module.base_layer)
    plain.load_state_dict(merged_state_dict(model))
    plain.save_pretrained(path)
