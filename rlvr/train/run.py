"""The running training job: `Run` holds its parts (rlvr.train.setup builds, opens, saves and
restores one; the training step and the methods take it).

    Run: cfg, dir, tokenizer, engine, learner, task, settings, rollouts, updater, methods
    collect(run, step)         the step's rollouts (what `run.rollouts.take` makes)
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

from rlvr.config import RunConfig
from rlvr.rollout.engine import Engine
from rlvr.train.collect import ROLLOUTS, Collected, Rollouts, Source
from rlvr.train.data import TaskData
from rlvr.train.learner import Learner
from rlvr.train.methods.base import Method
from rlvr.train.settings import UpdateSettings
from rlvr.train.updater import Updater
from rlvr.types import Group

__all__ = ["Run", "collect", "rescores_in_training"]


@dataclass
class Run:
    """Everything a running training job holds."""

    cfg: RunConfig
    dir: Path
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    """The embedded engine, vLLM, or rollout workers (rlvr.scaleout.rollout.RayEngine)."""
    learner: Learner
    task: TaskData
    settings: UpdateSettings
    """The update's settings before the methods adjust them for a step."""
    rollouts: Rollouts
    """Collection, the sampler and the replay buffer (rlvr.scaleout.pipeline: run ahead)."""
    updater: Updater
    """Runs the update (rlvr.scaleout.learners: on data-parallel ranks) and syncs the engine."""
    methods: dict[str, Method]
    """The methods composed beside the step (rlvr.train.methods), by name, in hook order."""
    command: str = "train"
    """The CLI command that runs it (train, sft, dpo), for the resume hints it prints."""
    processor: Any = None
    """A vision-language model's processor (its tokenizer, image processor, chat template): what
    renders prompts with images and what checkpoints save; None for a text model."""
    policy_version: int = 0
    """The policy's version where the run (re)started: the updates rollout workers had counted
    (`Completion.policy_version`), restored on resume so their count goes on."""
    checkpoint: Path | None = None
    """The checkpoint a resumed run started from (sharded learners read their shares there)."""


def rescores_in_training(run: Run) -> bool:
    """Whether `collect` lets the methods rescore a step's groups (`Method.rescore`): only when a
    reward is intrinsic, filled in from the policy itself (held-out evaluation always does)."""
    return any(r.intrinsic for r in run.task.rewards)


def collect(run: Run, step: int) -> Collected:
    """Step's rollouts: replayed groups, then fresh ones by the configured rollout strategy; the
    methods fill in rewards that need the policy (`Method.rescore`) before a strategy sees them."""
    t0 = time.perf_counter()
    cfg, task, replay = run.cfg, run.task, run.rollouts.replay
    n = cfg.train.prompts_per_step
    rng = np.random.default_rng([cfg.seed, step, 7])
    replayed = replay.take(n, step, rng) if replay is not None else []

    def rescore(groups: list[Group]) -> list[Group]:
        for method in run.methods.values():
            groups = method.rescore(run, groups, task.examples, held_out=False)
        return groups

    params = task.params
    for method in run.methods.values():  # e.g. a staged length
        params = method.sampling(params, step)
    episodes = task.episodes
    source = Source(run.engine, task.examples, task.prompt_ids, task.rewards, params, run.rollouts.sampler, rng,
                    on_error=cfg.on_reward_error, variants=task.variants,
                    episodes=None if episodes is None else lambda ix, k: episodes(run.engine, task.examples, ix, k),
                    rescore=rescore if rescores_in_training(run) else None, media=task.media)
    gathered = ROLLOUTS[cfg.sampler.rollouts](source, n - len(replayed), **cfg.sampler.rollouts_kwargs)
    return Collected(gathered, replayed, source.tokens, time.perf_counter() - t0)
