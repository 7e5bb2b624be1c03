"""`rlvr train`, `rlvr sft`, `rlvr dpo`: a config and its overrides, or a run to resume."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from rlvr.agents.openai_agent import AgentError
from rlvr.config import ConfigError, load_config
from rlvr.errors import MissingExtra, RunDirError
from rlvr.log.tracking import TrackerError
from rlvr.train.checkpoint import CheckpointError
from rlvr.train.loop import train
from rlvr.train.offline import dpo, sft

STOPS = (RunDirError, MissingExtra, CheckpointError, TrackerError, AgentError)
"""The errors a run stops with that `rlvr` reports in one line (exit status 2)."""


def run(args: argparse.Namespace) -> int:
    commands: dict[str, Callable[..., Any]] = {"train": train, "sft": sft, "dpo": dpo}
    job = commands[args.command]
    if args.resume:
        if args.config:
            raise ConfigError("--resume uses the run's own config.toml; pass changes as key=value overrides")
        job(resume=args.resume, overrides=tuple(args.overrides))
    else:
        job(load_config(args.config, args.overrides, command=args.command))
    return 0
