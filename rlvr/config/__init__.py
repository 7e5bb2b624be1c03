"""Typed, frozen run configuration: TOML files, dotted command-line overrides, clear errors.

A config is a tree of pydantic models: the sections (rlvr.config.sections) under one root per
command (`rlvr train`'s RunConfig, `rlvr sft`'s, `rlvr dpo`'s). Each field's docstring is its
entry in `rlvr config`. Reading files and overrides, the errors, and writing a run's config.toml
are rlvr.config.files. Unknown keys are rejected with the nearest valid key; bad values name the
key and what is allowed.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from rlvr.options import Summarize, options

from rlvr.config.sections import (AlgoConfig, ConfigError, DistConfig, DPOConfig, EngineConfig, EnvConfig,
                                  ExpertConfig, LogConfig, LoraConfig, MixtureEntry, RewardConfig, SamplerConfig,
                                  SamplingConfig, SandboxConfig, SFTConfig, ShapingSpec, TaskConfig, TrainConfig,
                                  _Section)


class RunConfig(_Section):
    name: str = "run"
    """Run name: everything goes to <output_dir>/<name>/."""
    output_dir: str = "runs"
    """Parent directory of run directories."""
    model: str = "builtin:smollm2-135m-instruct"
    """Policy model: "builtin:smollm2-135m-instruct", a local path, or a Hugging Face id."""
    seed: int = 0
    """Seed for data, sampling and initialisation."""
    checkpoint_every: int = Field(0, ge=0)
    """Save a checkpoint every N steps (0 = only at the end)."""
    keep_checkpoints: int = Field(2, ge=1)
    """Most recent checkpoints kept on disk."""
    samples_every: int = Field(1, ge=1)
    """Write every N-th step's prompts, completions and rewards to samples.jsonl."""
    task: TaskConfig = Field(default_factory=TaskConfig)
    on_reward_error: Literal["zero", "stop"] = "zero"
    """A reward that raises, times out or returns a non-number: "zero" scores 0 and counts it (<name>/error); "stop" ends the run with the traceback and the completion."""
    rewards: list[RewardConfig] = Field(default_factory=list)
    """Reward functions, summed with their weights; the first is the correctness reward behind
    "accuracy". Default: the task's own verifier (reasoning-gym's score_answer on the answer in
    <answer> tags, or math-verify against the JSONL answer column)."""
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    algo: AlgoConfig = Field(default_factory=AlgoConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    sandbox: SandboxConfig = Field(default_factory=SandboxConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    env: EnvConfig = Field(default_factory=EnvConfig)
    dist: DistConfig = Field(default_factory=DistConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    expert: ExpertConfig = Field(default_factory=ExpertConfig)

    command: ClassVar[str] = "train"
    """The CLI command this config root belongs to."""
    partial: ClassVar[dict[str, tuple[str, ...]]] = {}
    """Sections this command reads only in part: section -> the keys it reads (none: it ignores the
    section). Setting any other key of them is refused, so nothing set is silently ignored."""

    def reward_specs(self) -> list[dict[str, Any]]:
        """The reward specs for rlvr.rewards.build_rewards, with the source field for routing."""
        return [{**r.model_dump(), "source_field": self.sampler.source_field} for r in self.rewards]

    @field_validator("name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if not value or "/" in value or "\\" in value or value in (".", ".."):
            raise ValueError(f"{value!r} is not a plain directory name (no slashes; it goes under output_dir)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _default_rewards(cls, data: Any) -> Any:
        env = data.get("env") if isinstance(data, dict) else None
        if isinstance(env, dict) and env.get("name") in ("verifiers", "openenv", "harbor"):  # the environment brings its prompts
            task = data.get("task") if isinstance(data.get("task"), dict) else {}
            if "source" not in task:
                data = {**data, "task": {**task, "source": "env"}}
        if isinstance(data, dict) and not data.get("rewards"):
            task = data.get("task")
            source = task.get("source", "reasoning_gym") if isinstance(task, dict) else "reasoning_gym"
            params = task.get("params") if isinstance(task, dict) else None
            layout = params.get("format", "rlvr") if isinstance(params, dict) else "rlvr"
            if layout != "rlvr":
                raise ValueError(f"task.params.format = {layout!r} needs [[rewards]]: name the reward functions written for "
                                 f"that data, e.g. [[rewards]] fn = \"mypkg.rewards:accuracy\" (style is read from "
                                 "the signature)")
            if source == "humaneval":
                data = {**data, "rewards": [{"fn": "unit_tests"}]}
            elif source == "text":
                data = {**data, "rewards": [{"fn": "information_gain"}]}
            else:
                fn = "math_verify" if source in ("jsonl", "parquet", "hf") else "reasoning_gym"
                data = {**data, "rewards": [{"fn": fn, "kwargs": {"extract": "tag"}}]}
        return data

    @model_validator(mode="after")
    def _read(self) -> RunConfig:
        for section, keys in self.partial.items():
            unread = sorted(getattr(self, section).model_fields_set - set(keys))
            if unread:
                raise ValueError(f"`rlvr {self.command}` does not read {section}.{unread[0]} (a setting of `rlvr "
                                 f"train`); remove it from this config")
        return self

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        """Refuse combinations of sections that cannot run together, each with what to change."""
        batch = self.train.prompts_per_step * self.algo.group_size
        if batch % self.train.mini_batches:
            raise ValueError(
                f"train.mini_batches = {self.train.mini_batches} must divide prompts_per_step × "
                f"group_size = {batch}"
            )
        self._check_dist()
        self._check_env()
        return self

    def _check_dist(self) -> None:
        """Rollout workers, asynchronous steps, partial rollouts and data-parallel learners."""
        d, r, a = self.dist, self.dist.ray_options(), self.dist.async_options()
        if d.rollout_workers and self.engine.backend == "vllm":
            if d.partial_rollouts():
                raise ValueError("dist.async_rollouts.partial_rollouts needs the embedded engine: vLLM finishes a "
                                 "request on the weights it started with")
        if a is not None and not d.rollout_workers:
            raise ValueError("dist.async_rollouts needs dist.rollout_workers >= 1: the policy cannot train while it "
                             "samples in the same process")
        actors = (d.rollout_workers + d.learners - 1) * r.cpus_per_worker
        if r.address is None and r.num_cpus is not None and r.num_cpus < actors:
            raise ValueError(f"dist.ray.num_cpus = {r.num_cpus} is fewer than the {actors:g} CPUs the actors reserve "
                             f"({d.rollout_workers} rollout workers and {d.learners - 1} learner actors, "
                             f"cpus_per_worker = {r.cpus_per_worker:g} each): they would never start")
        if d.learners > 1 and _on_gpu(self.train.device) and not r.gpus_per_learner:
            raise ValueError("data-parallel learners on GPUs need one each: set dist.ray.gpus_per_learner = 1")

    def _check_env(self) -> None:
        """What needs multi-turn episodes, and what summarised episodes cannot train."""
        if self.algo.credit == "turn" and self.env.name is None:
            raise ValueError("algo.credit = \"turn\" needs multi-turn episodes: set env.name")
        e = self.env
        if "void" in e.mask and e.name in ("openai_agent", "verifiers"):
            # their episodes run the user's own agent or environment, which never reports a void
            # turn (rlvr.agents.runner's `metrics["void"]`): the mask would silently mask nothing
            raise ValueError(f"env.mask = [\"void\"] needs an environment that reports void turns; {e.name!r} "
                             "episodes never do. Leave \"void\" out (\"unfinished\" works with them)")
        if e.summarize:
            at = options("env.summarize", Summarize, e.summarize).at
            if e.name is None:
                raise ValueError("env.summarize needs multi-turn episodes: set env.name")
            if at >= e.max_context:
                raise ValueError(f"env.summarize.at ({at}) must be below env.max_context ({e.max_context}): "
                                 "the summary is written inside the context")


def _on_gpu(device: str) -> bool:
    """Whether train.device puts the learner on a GPU ("auto" does where torch sees one)."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


class SFTRunConfig(RunConfig):
    """`rlvr sft`'s config: the run, its task (whose held-out prompts evaluate it), the model, the
    optimizer in [train], and [sft]."""

    sft: SFTConfig = Field(default_factory=SFTConfig)
    command: ClassVar[str] = "sft"
    partial: ClassVar[dict[str, tuple[str, ...]]] = {
        "algo": (), "sampler": (), "env": (), "dist": (), "expert": ()}


class DPORunConfig(RunConfig):
    """`rlvr dpo`'s config: the run, its task, the model, the optimizer in [train], and [dpo]; online
    DPO samples as `rlvr train` does (sampling, sampler, env, algo.group_size)."""

    dpo: DPOConfig = Field(default_factory=DPOConfig)
    command: ClassVar[str] = "dpo"
    partial: ClassVar[dict[str, tuple[str, ...]]] = {"algo": ("group_size",), "dist": (), "expert": ()}


ROOTS: dict[str, type[RunConfig]] = {"train": RunConfig, "sft": SFTRunConfig, "dpo": DPORunConfig}
"""Each command's config root: `rlvr train`'s, `rlvr sft`'s, `rlvr dpo`'s."""


# Reading and writing configs; imported last, since it reads the roots above.
from rlvr.config.files import (MOVED, apply_override, declared_keys, describe, from_dict, load_config,  # noqa: E402
                               to_toml, written_version)

__all__ = ["AlgoConfig", "ConfigError", "DistConfig", "DPOConfig", "DPORunConfig", "EngineConfig", "EnvConfig",
           "ExpertConfig", "LogConfig", "LoraConfig", "MixtureEntry", "MOVED", "RewardConfig", "ROOTS", "RunConfig",
           "SamplerConfig", "SamplingConfig", "SandboxConfig", "SFTConfig", "SFTRunConfig", "ShapingSpec",
           "TaskConfig", "TrainConfig", "apply_override", "declared_keys", "describe", "from_dict", "load_config",
           "to_toml", "written_version"]
