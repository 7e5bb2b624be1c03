"""rlvr: reinforcement-learning post-training of language models, readable and CPU-first.

The public API, importable from `rlvr` directly (loaded on first use, so `import rlvr` is cheap):

    load_config, RunConfig, ConfigError         configuration (rlvr.config)
    train                                       the whole training job (rlvr.train.loop)
    load_model, load_tokenizer, eos_token_ids   models (rlvr.models)
    EmbeddedEngine, Engine                      rollout (rlvr.rollout.engine)
    SamplingParams, Completion, Sample, Group   data types (rlvr.types)
    reasoning_gym_examples, jsonl_examples, render_prompt, Example     prompts (rlvr.data)
    build_rewards, score, REWARDS, extract_answer                      rewards (rlvr.rewards)
    generate_groups, group_metrics              rollouts + scoring (rlvr.train.rollouts)
    Learner, UpdateSettings, update_policy, UpdateResult, compute_advantages   learning (rlvr.train)
    AdvantageSettings, LossSettings, KLSettings, Passes    the parts of UpdateSettings (rlvr.train.settings)
    ESTIMATORS, LOSSES, KL_ESTIMATORS, aggregate_loss                  algorithms (rlvr.algos)
    keep_freed_memory                           CPU malloc tuning for training processes (rlvr.runtime)
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.2.0"

_EXPORTS = {
    "rlvr.config": ["load_config", "RunConfig", "ConfigError"],
    "rlvr.train.loop": ["train"],
    "rlvr.models": ["load_model", "load_tokenizer", "eos_token_ids"],
    "rlvr.rollout.engine": ["EmbeddedEngine", "Engine"],
    "rlvr.types": ["SamplingParams", "Completion", "Sample", "Group"],
    "rlvr.data": ["reasoning_gym_examples", "jsonl_examples", "render_prompt", "Example"],
    "rlvr.rewards": ["build_rewards", "score", "REWARDS", "extract_answer"],
    "rlvr.train.rollouts": ["generate_groups", "group_metrics"],
    "rlvr.train.learner": ["Learner"],
    "rlvr.train.update": ["UpdateSettings", "update_policy", "UpdateResult", "compute_advantages"],
    "rlvr.train.settings": ["AdvantageSettings", "LossSettings", "KLSettings", "Passes"],
    "rlvr.algos": ["ESTIMATORS", "LOSSES", "KL_ESTIMATORS", "aggregate_loss"],
    "rlvr.runtime": ["keep_freed_memory"],
}
_WHERE = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'rlvr' has no attribute {name!r}")
    if name == "train":  # the package, callable as the job (rlvr/train/__init__.py): one object, whatever ran first
        return importlib.import_module("rlvr.train")
    return getattr(importlib.import_module(_WHERE[name]), name)
