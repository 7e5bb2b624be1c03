"""The training loop, as plain functions: set up a run, then sample → score → update, step by step.

    for step in steps:
        prompts   = sampler.next_batch(prompts_per_step)
        groups    = engine samples G completions per prompt; reward functions score them
        sampler.observe(groups)
        learner   = advantages (by name) → policy loss (by name) over epochs × mini-batches
        engine    ← new weights (nothing to copy when engine and learner share the model)
        log metrics and samples; checkpoint every N steps

Departures from the GRPO paper (arXiv:2402.03300), all configurable: clip-higher by default
(clip_high = 0.28, DAPO), token-mean loss aggregation (DAPO), no KL term unless kl_coef > 0.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil
import signal
import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlvr import dist, sandbox
from rlvr.agents.runner import episode_metrics
from rlvr.algos import ESTIMATORS
from rlvr.algos.kl import KLController
from rlvr.algos.registry import loop_inputs
from rlvr.config import RunConfig, load_config, to_toml
from rlvr.data import Example, render_prompt
from rlvr.data.sampler import Sampler
from rlvr.eval.metrics import pass_at_k
from rlvr.log import ConsoleProgress, JsonlSink, ScreeningProgress, tracking
from rlvr.log.sinks import read_jsonl
from rlvr.lora import ADAPTER_DIR, apply_lora, merged_state_dict
from rlvr.models import eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_dtype, resolve_model_path
from rlvr.rewards import RewardFn, build_rewards
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.runtime import keep_freed_memory
from rlvr.train import checkpoint as ckpt
from rlvr.train.collect import ROLLOUTS, Gathered, ReplayBuffer, Source, template_variants
from rlvr.train.critic import Critic
from rlvr.train.data import load_examples, make_episodes, make_sampler
from rlvr.train.learner import Learner
from rlvr.train.rehearsal import FILE as REHEARSAL_FILE
from rlvr.train.rehearsal import Rehearsal, screen_order
from rlvr.train.rollouts import generate_groups, group_metrics, is_correct
from rlvr.train import rlp
from rlvr.train.expert import Relift, chord_settings, demonstration, mix_in, own_share, step_demonstrations
from rlvr.train.update import (
    UpdateSettings,
    imitation_step,
    needs_greedy_baseline,
    score_certainty,
    score_logprobs,
    update_policy,
)
from rlvr.types import Group, SamplingParams


class RunDirError(RuntimeError):
    """The run directory cannot be used as asked (exists already, or nothing to resume)."""


@dataclass
class Run:
    """Everything a running training job holds."""

    cfg: RunConfig
    dir: Path
    tokenizer: Any
    engine: Any
    """An Engine: the embedded one, vLLM, or rollout workers (rlvr.dist.rollout.RayEngine)."""
    learner: Learner
    ref_model: Any
    rewards: list[RewardFn]
    examples: list[Example]
    prompt_ids: list[list[int]]
    eval_examples: list[Example]
    eval_ids: list[list[int]]
    sampler: Sampler
    update_generator: torch.Generator
    settings: UpdateSettings
    params: SamplingParams
    shared_weights: bool
    critic: Learner | None = None
    """The value model's learner (advantage = "gae" only)."""
    kl: KLController | None = None
    """The KL coefficient, fixed or adaptive (kl_placement = "reward" with kl_target)."""
    loss_state: dict[str, float] = dataclasses.field(default_factory=dict)
    """What a stateful loss keeps across steps (R²VPO's λ)."""
    rehearsal: Rehearsal | None = None
    """Stored samples of the initial policy for algo.divergence (DPH-RL)."""
    replay: ReplayBuffer | None = None
    """Recent groups replayed into later steps (sampler.replay_fraction > 0)."""
    variants: Any = None
    """Prompt augmentation: the per-rollout prompts of an index (sampler.templates)."""
    episodes: Any = None
    """Multi-turn environments (env.name): (prompt indices, n) → groups of episodes."""
    pipeline: Any = None
    """Asynchronous rollouts (dist.async_steps > 0, rlvr.dist.pipeline.Pipeline)."""
    data_parallel: Any = None
    """Data-parallel learners (dist.learners > 1, rlvr.dist.learners.DataParallel): runs each update on every rank."""
    relift: Any = None
    """ReLIFT's buffer of hard prompts (expert.mode = "relift", rlvr.train.expert.Relift)."""
    ema: Any = None
    """RLP's no-think baseline: an EMA of the policy (reward fn = "information_gain", rlvr.train.rlp)."""
    command: str = "train"
    """The CLI command that runs it (train, sft, dpo), for the resume hints it prints."""


def setup(cfg: RunConfig, run_dir: Path, model_spec: str | None = None, quiet: bool = True,
          optimizer_steps: int | None = None) -> Run:
    """Load model, tokenizer, data and rewards; build the engine and the learner (and, for
    algo.divergence, screen the initial policy for its rehearsal set, with a progress bar unless quiet)."""
    keep_freed_memory()  # ~1.4x faster learner steps on CPU; see rlvr.runtime
    torch.manual_seed(cfg.seed)
    sandbox.configure(cfg.sandbox.isolation, cfg.sandbox.limits(), cfg.sandbox.parallelism)  # for code rewards
    spec = model_spec or cfg.model
    tokenizer = load_tokenizer(spec)
    device = resolve_device(cfg.train.device)
    train_dtype = resolve_dtype(cfg.train.precision, device)
    engine_dtype = resolve_dtype(cfg.engine.dtype, device)
    lora = cfg.lora.rank > 0
    # With LoRA a checkpoint holds the merged model and its adapter: a resumed run puts the adapter back on the base
    model = load_model(cfg.model if lora else spec, train_dtype, device)
    if cfg.train.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # Same dtype: the engine samples from the learner's own weights, so updates need no copy. With
    # LoRA the engine keeps a plain copy of the base and loads the merged weights after each update.
    vllm = cfg.engine.backend == "vllm"
    shared = engine_dtype == train_dtype and not lora and not vllm
    engine_model = model if shared or vllm else copy.deepcopy(model).to(engine_dtype)  # type: ignore[arg-type]
    if lora:
        adapter = Path(spec) / ADAPTER_DIR if model_spec else None
        model = apply_lora(model, rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                           targets=cfg.lora.targets, adapter=adapter)
    engine: Any
    if vllm:  # sampling on the GPU; the learner's (merged) weights reach it after every update
        from rlvr.rollout.vllm_engine import VLLMEngine

        engine = VLLMEngine(resolve_model_path(spec), tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                            seed=cfg.seed, dtype=str(engine_dtype).removeprefix("torch."), **cfg.engine.vllm_kwargs)
    else:
        engine = EmbeddedEngine(engine_model, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                                max_batch_size=cfg.engine.max_batch_size, seed=cfg.seed, decoder=cfg.engine.decoder)
    ref_model = None
    if cfg.algo.kl_coef > 0:
        ref_model = load_model(cfg.model, train_dtype, device).eval().requires_grad_(False)
    tr = cfg.train
    optimizer_steps = optimizer_steps or tr.steps * tr.epochs * tr.mini_batches
    learner = Learner(model, lr=tr.lr, betas=tr.betas, weight_decay=tr.weight_decay, grad_clip=tr.grad_clip,
                      warmup_steps=tr.warmup_steps, total_steps=optimizer_steps, schedule=tr.schedule)
    examples, held = load_examples(cfg)
    if cfg.task.source == "text":  # RLP: the raw context, then the thought's opening marker
        encode = lambda exs: [rlp.prompt_ids(tokenizer, ex.fields["context"], cfg.rlp.think_open)  # noqa: E731
                              for ex in exs]
    else:
        encode = lambda exs: [render_prompt(tokenizer, ex.prompt, cfg.task.system_prompt) for ex in exs]  # noqa: E731
    a, s = cfg.algo, cfg.sampling
    settings = UpdateSettings(
        advantage=a.advantage, advantage_kwargs=dict(a.advantage_kwargs),
        loss=a.loss, loss_kwargs=a.policy_loss_kwargs(), offpolicy=a.offpolicy,
        offpolicy_kwargs=dict(a.offpolicy_kwargs),
        shaping=tuple((spec.fn, dict(spec.kwargs)) for spec in a.shaping), mask_truncated=a.mask_truncated,
        stratum_key=a.stratum_key, credit=a.credit, turn_gamma=a.turn_gamma,
        aggregation=a.aggregation, max_tokens=cfg.env.max_total_tokens if cfg.env.name else s.max_new_tokens, kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
        kl_placement=a.kl_placement, value_clip=a.value_clip, divergence=a.divergence,
        divergence_coef=a.divergence_coef,
        entropy_coef=a.entropy_coef, epochs=tr.epochs, mini_batches=tr.mini_batches,
        micro_batch_size=tr.micro_batch_size, micro_batch_tokens=tr.micro_batch_tokens, temperature=s.temperature,
        logprob_chunk=tr.logprob_chunk,
    )
    params = SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                            max_new_tokens=s.max_new_tokens, stop=tuple(s.stop), n=a.group_size)
    critic = None
    if "values_BT" in loop_inputs(ESTIMATORS[a.advantage]):  # PPO with GAE: a learned value model
        critic = Learner(Critic(model), lr=a.critic_lr, betas=tr.betas, weight_decay=tr.weight_decay,
                         grad_clip=tr.grad_clip, warmup_steps=tr.warmup_steps, total_steps=optimizer_steps,
                         schedule=tr.schedule)
    rewards = build_rewards(cfg.reward_specs())
    # the parts that make up the reward (BNPO's decomposition fits these), not flags or weight-0 diagnostics
    components = ("env",) if cfg.env.name else tuple(r.name for r in rewards if r.weight != 0)
    settings = dataclasses.replace(settings, reward_components=components)
    prompt_ids = encode(examples)
    rehearsal = None
    if a.divergence != "none":
        rehearsal = _rehearsal(cfg, run_dir, engine, model, examples, prompt_ids, rewards, params, settings,
                               resuming=model_spec is not None, quiet=quiet)
        if a.rehearsal_exclude:  # RL trains on what the initial policy could not already solve
            solved = rehearsal.prompt_indices
            examples = [ex for i, ex in enumerate(examples) if i not in solved]
            prompt_ids = [ids for i, ids in enumerate(prompt_ids) if i not in solved]
            if not examples:
                raise ValueError(f"every training prompt joined the rehearsal set ({rehearsal.screened} screened), "
                                 "so none is left for RL; raise task.size or algo.rehearsal_min_correct, or set "
                                 "algo.rehearsal_exclude = false")
    sc = cfg.sampler
    replay = ReplayBuffer(sc.replay_capacity, sc.replay_fraction, sc.replay_max_age) if sc.replay_fraction else None
    variants = None
    if sc.templates:
        variants = template_variants(sc.templates, lambda text: render_prompt(tokenizer, text, cfg.task.system_prompt),
                                     examples)
    return Run(cfg, run_dir, tokenizer, engine, learner, ref_model, rewards,
               examples, prompt_ids, held, encode(held), make_sampler(cfg, examples),
               torch.Generator().manual_seed(cfg.seed), settings, params, shared, critic,
               KLController(a.kl_coef, a.kl_target, a.kl_horizon), rehearsal=rehearsal, replay=replay,
               variants=variants, episodes=make_episodes(cfg, engine, tokenizer, examples, rewards, params),
               relift=Relift() if cfg.expert.mode == "relift" else None,
               ema=load_model(cfg.model, train_dtype, device).eval().requires_grad_(False)
               if any(r.fn is rlp.information_gain for r in rewards) else None)


def _rehearsal(cfg: RunConfig, run_dir: Path, engine: EmbeddedEngine, model: Any, examples: list[Example],
               prompt_ids: list[list[int]], rewards: list[RewardFn], params: SamplingParams,
               settings: UpdateSettings, resuming: bool, quiet: bool) -> Rehearsal:
    """The run's rehearsal set: read back from the run directory, or screened now with the initial policy."""
    if (run_dir / REHEARSAL_FILE).is_file():
        return Rehearsal.load(run_dir)
    if resuming:
        raise RunDirError(f"{run_dir} has no {REHEARSAL_FILE}: algo.divergence needs samples of the initial "
                          "policy, which a resumed run no longer has; start a new run to use it")
    a = cfg.algo
    order = screen_order(len(examples), a.rehearsal_prompts, cfg.seed)
    with ScreeningProgress(len(order), a.rehearsal_k, disable=quiet) as progress:
        groups = generate_groups(engine, examples, prompt_ids, order, rewards,
                                 dataclasses.replace(params, n=a.rehearsal_k), progress=progress.advance)
        primary = rewards[0].name
        needed = a.rehearsal_min_correct or a.rehearsal_k
        keep = [next(x for x in g.samples if is_correct(x, primary)) for g in groups
                if sum(is_correct(x, primary) for x in g.samples) >= needed]
        progress.report(len(keep), needed)
    # log π_0 as the learner computes it (the engine's are after top-k/top-p, and in its dtype)
    init = score_logprobs(model, keep, settings, engine.pad_token_id, set(range(len(keep))))
    samples = [dataclasses.replace(x, completion=dataclasses.replace(x.completion, logprobs=tuple(lp.tolist())))
               for x, lp in zip(keep, init)]
    rehearsal = Rehearsal(samples, screened=len(order))
    rehearsal.save(run_dir)
    return rehearsal


def train_step(run: Run, step: int, progress: ConsoleProgress | None = None) -> tuple[dict[str, Any], list[Group]]:
    """One step: sample, score, update. Returns the step's metrics and its groups."""
    t0 = time.perf_counter()
    if progress:
        progress.status("generating")
    # asynchronous (dist.async_steps): this step's rollouts were generated during earlier updates
    collected = run.pipeline.take(step) if run.pipeline is not None else collect(run, step)
    gathered, replayed = collected.gathered, collected.replayed
    serving = getattr(run.engine, "version", None)  # rollout workers: the weights' version before this update
    stale_dropped = _mark_stale(run, gathered, serving)
    fresh = gathered.train
    groups = fresh + replayed
    if not groups:  # e.g. dynamic sampling found no group with differing rewards: nothing to learn
        skipped = _skipped_step(run, step, gathered, t0)
        if run.pipeline is not None:
            skipped["dist/stale_dropped"] = float(stale_dropped)
        return skipped, []
    indices = [g.samples[0].prompt_index for g in groups]
    greedy_baseline = needs_greedy_baseline(run.settings.advantage)
    if greedy_baseline:  # ReMax: one greedy completion (multi-turn: a greedy episode) per prompt as baseline
        greedy_params = dataclasses.replace(run.params, temperature=0.0, top_k=0, top_p=1.0, n=1)
        if run.episodes is not None:
            greedy = run.episodes(indices, 1, sampling=greedy_params)
        else:
            greedy = generate_groups(run.engine, run.examples, run.prompt_ids, indices, run.rewards, greedy_params)
        groups = [dataclasses.replace(g, metadata={**g.metadata, "greedy_reward": b.samples[0].reward})
                  for g, b in zip(groups, greedy)]
    fresh = groups[: len(fresh)]  # the same groups, now with intrinsic rewards and baselines filled in
    t1 = time.perf_counter()
    if progress:
        progress.status("training")
    settings = run.settings
    if run.kl is not None and run.kl.target is not None:  # the adaptive coefficient of this step
        settings = dataclasses.replace(settings, kl_coef=run.kl.value)
    own = fresh  # the policy's own groups (the sampler observes these)
    mode, demos = run.cfg.expert.mode, None
    if mode == "luffy":  # each group gets its prompt's demonstration as an off-policy sample
        groups = mix_in(run, groups)
        fresh = groups[: len(fresh)]
    elif mode == "chord":  # (1 − μ)·RL + μ·SFT on this step's demonstrations
        settings = dataclasses.replace(chord_settings(run, step), kl_coef=settings.kl_coef)
        demos = step_demonstrations(run, groups)
    updater = run.data_parallel.update if run.data_parallel is not None else update_policy
    update = updater(run.learner, groups, settings, pad_token_id=run.engine.pad_token_id,
                           ref_model=run.ref_model, generator=run.update_generator, critic=run.critic,
                           loss_state=run.loss_state,
                           rehearsal=run.rehearsal.next_batch(run.cfg.algo.rehearsal_batch) if run.rehearsal else None,
                           expert=demos)
    if mode == "chord":
        update["expert/mu"] = settings.expert_coef
    elif mode == "luffy":  # the sampler observes the policy's own samples, with their advantages
        own_share(own, groups)
    if run.kl is not None and "kl_reward" in update:
        run.kl.update(update["kl_reward"], n=sum(len(g.samples) for g in groups))
    if run.ema is not None:  # RLP's no-think baseline follows the policy slowly
        rlp.ema_update(run.ema, run.learner.model, run.cfg.rlp.ema_decay)
    if run.relift is not None:  # ReLIFT: SFT on the demonstrations of prompts RL keeps failing
        e = run.cfg.expert
        run.relift.add(own, e.relift_max_accuracy, run.rewards[0].name)
        hard = run.relift.take(e.relift_batch)
        if hard is not None:
            update |= imitation_step(run.learner, [demonstration(run, i, tuple(run.prompt_ids[i])) for i in hard],
                                     settings, pad_token_id=run.engine.pad_token_id)
        update["expert/relift_pending"] = float(len(run.relift.pending))
        update["expert/relift_sft"] = float(hard is not None)
    if not run.shared_weights:
        run.engine.update_weights(merged_state_dict(run.learner.model))
    _observe(run, own, gathered.aside, step)
    t2 = time.perf_counter()
    if greedy_baseline:
        update["greedy_reward"] = statistics.fmean(g.metadata["greedy_reward"] for g in groups)
    metrics = {"step": step, **group_metrics(fresh + gathered.aside or groups, run.rewards[0].name), **update,
               **_sampling_metrics(run, gathered, replayed), "lr": run.learner.applied_lr}
    metrics["tokens_generated"] = float(collected.tokens)  # everything sampled, down-sampled away or not
    metrics |= episode_metrics(fresh + gathered.aside)
    if hasattr(run.engine, "metrics"):  # rollout workers: weight version, restarts
        metrics |= run.engine.metrics()
        versions = [x.completion.policy_version for g in fresh for x in g.samples]
        if serving is not None and versions and None not in versions:
            metrics["dist/staleness_max"] = float(serving - min(v for v in versions if v is not None))
        if run.pipeline is not None:  # generate_seconds is then the wait for rollouts made during earlier updates
            metrics["dist/stale_dropped"] = float(stale_dropped)
            metrics["dist/rollout_seconds"] = collected.seconds
        if run.cfg.dist.partial_rollouts:  # samples that newer weights finished
            crossed = [bool(x.completion.swapped_at) for g in fresh for x in g.samples]
            metrics["dist/partial_fraction"] = statistics.fmean(crossed) if crossed else 0.0
    if run.rehearsal is not None:
        metrics["rehearsal_size"] = len(run.rehearsal.samples)
    metrics |= {"generate_seconds": t1 - t0, "train_seconds": t2 - t1, "step_seconds": t2 - t0,
                "tokens_per_second": metrics["tokens_generated"] / (t2 - t0)}
    return metrics, groups


@dataclass
class Collected:
    """A step's rollouts, as the rollout strategy gathered them."""

    gathered: Gathered
    replayed: list[Group]
    tokens: int
    """Completion tokens sampled (kept or not)."""
    seconds: float


def collect(run: Run, step: int) -> Collected:
    """Step's rollouts: replayed groups, then fresh ones by the configured rollout strategy."""
    t0 = time.perf_counter()
    cfg = run.cfg
    n = cfg.train.prompts_per_step
    rng = np.random.default_rng([cfg.seed, step, 7])
    replayed = run.replay.take(n, step, rng) if run.replay is not None else []

    def intrinsic(gs: list[Group]) -> list[Group]:  # self-certainty, information gain...: from the policy itself
        gs = score_intrinsic(run.learner.model, gs, run.rewards, run.settings, run.engine.pad_token_id)
        return rlp.score_groups(run, gs)

    source = Source(run.engine, run.examples, run.prompt_ids, run.rewards, run.params, run.sampler, rng,
                    on_error=cfg.on_reward_error, variants=run.variants, episodes=run.episodes,
                    rescore=intrinsic if any(r.intrinsic for r in run.rewards) else None)
    gathered = ROLLOUTS[cfg.sampler.rollouts](source, n - len(replayed), **cfg.sampler.rollouts_kwargs)
    return Collected(gathered, replayed, source.tokens, time.perf_counter() - t0)


def _mark_stale(run: Run, gathered: Gathered, serving: int | None) -> int:
    """Asynchronous rollouts: groups with a sample from older weights are trained against their
    sampling log-probs ("stale"); with dist.on_stale = "drop", groups staler than
    dist.max_staleness are set aside, untrained. Returns how many were."""
    if serving is None or run.pipeline is None:
        return 0
    d, kept, dropped = run.cfg.dist, [], 0
    for g in gathered.train:
        staleness = serving - min(x.completion.policy_version or 0 for x in g.samples)
        if staleness > d.max_staleness and d.on_stale == "drop":
            dropped += 1
            gathered.aside.append(g)  # not trained on; the sampler still observes it
            continue
        if staleness > 0:
            g.metadata["stale"] = staleness
        kept.append(g)
    gathered.train = kept
    return dropped


def _observe(run: Run, fresh: list[Group], aside: list[Group], step: int) -> None:
    """The sampler learns from every group generated this step (set-aside ones have zero
    advantage); the replay buffer keeps the fresh ones. Asynchronous: on the rollout thread, after
    the collections already under way (rlvr.dist.pipeline)."""
    if run.pipeline is not None:
        run.pipeline.after(_observe_now, run, fresh, aside, step)
    else:
        _observe_now(run, fresh, aside, step)


def _observe_now(run: Run, fresh: list[Group], aside: list[Group], step: int) -> None:
    for g in aside:
        g.metadata.setdefault("advantages", [0.0] * len(g.samples))
    run.sampler.observe(fresh + aside)
    if run.replay is not None:
        run.replay.add(fresh, step)


def _sampling_metrics(run: Run, gathered: Gathered, replayed: list[Group]) -> dict[str, float]:
    out = {"epoch": float(getattr(run.sampler, "epoch", 0.0)), **gathered.metrics}
    if hasattr(run.sampler, "metrics"):
        out |= {f"sampler/{k}": float(v) for k, v in run.sampler.metrics().items()}
    if run.replay is not None:
        out["replay/groups"] = float(len(replayed))
        out["replay/age_mean"] = statistics.fmean(g.metadata["age"] for g in replayed) if replayed else 0.0
        out["replay/buffer_size"] = float(len(run.replay.items))
    return out


def _skipped_step(run: Run, step: int, gathered: Gathered, t0: float) -> dict[str, Any]:
    """A step with no group to train on: its rollouts are observed and logged, the policy is unchanged."""
    _observe(run, [], gathered.aside, step)
    seconds = time.perf_counter() - t0
    metrics = {"step": step, **group_metrics(gathered.aside, run.rewards[0].name),
               **_sampling_metrics(run, gathered, []), "lr": run.learner.applied_lr, "skipped_update": 1.0,
               "generate_seconds": seconds, "train_seconds": 0.0, "step_seconds": seconds}
    metrics["tokens_per_second"] = metrics["tokens_generated"] / seconds
    return metrics


def score_intrinsic(model: Any, groups: list[Group], rewards: list[RewardFn], s: UpdateSettings,
                    pad_token_id: int) -> list[Group]:
    """Fill in the intrinsic rewards (rlvr.rewards.intrinsic) with one no-gradient pass of the
    policy over the completions, and add them to each sample's total."""
    intrinsic = [r for r in rewards if r.intrinsic and r.fn is not rlp.information_gain]  # RLP's: rlp.score_groups
    if not intrinsic:
        return groups
    samples = [x for g in groups for x in g.samples]
    certainty, negative_entropy = score_certainty(model, samples, pad_token_id, temperature=s.temperature,
                                                  micro_batch_size=s.micro_batch_size, chunk_size=s.logprob_chunk)
    out, k = [], 0
    for g in groups:
        scored = []
        for x in g.samples:
            parts = dict(x.reward_parts)
            total = x.reward
            for r in intrinsic:
                parts[r.name] = r.fn(float(certainty[k]), float(negative_entropy[k]))
                total += r.weight * parts[r.name]
            scored.append(dataclasses.replace(x, reward=total, reward_parts=parts))
            k += 1
        out.append(dataclasses.replace(g, samples=tuple(scored)))
    return out


def evaluate(run: Run, step: int = 0) -> dict[str, float]:
    """Greedy decoding on the held-out prompts: accuracy and mean reward. With
    train.eval_samples = n, also n samples per prompt at the training temperature: eval/pass@k
    (unbiased estimator) for k = 1, 2, 4, ... and n, from a generator seeded by the step, so the
    training stream of random numbers is untouched and resume stays exact."""
    if run.pipeline is not None:  # the engine's random stream is not shared with a collection under way
        run.pipeline.drain()
    if not run.eval_examples:
        return {}
    everything = list(range(len(run.eval_examples)))
    params = SamplingParams(temperature=0.0, max_new_tokens=run.params.max_new_tokens, stop=run.params.stop, n=1)
    if run.episodes is not None:  # multi-turn: greedy episodes in fresh environments
        groups = run.episodes(everything, 1, on=run.eval_examples, sampling=params)
    else:
        groups = generate_groups(run.engine, run.eval_examples, run.eval_ids, everything, run.rewards, params)
        groups = rlp.score_groups(run, groups, run.eval_examples)  # RLP: the greedy thoughts' information gain
    m = group_metrics(groups, run.rewards[0].name)
    out = {"eval/accuracy": m["accuracy"], "eval/reward": m["reward"], "eval/response_length": m["response_length"]}
    out |= {f"eval/{k}": v for k, v in episode_metrics(groups).items()}
    n = run.cfg.train.eval_samples
    if n:
        generator = run.engine.generator
        saved = generator.get_state()
        generator.manual_seed(run.cfg.seed * 1_000_003 + step)
        try:
            if run.episodes is not None:
                sampled = run.episodes(everything, n, on=run.eval_examples)
            else:
                sampled = generate_groups(run.engine, run.eval_examples, run.eval_ids, everything, run.rewards,
                                          dataclasses.replace(run.params, n=n))
        finally:
            generator.set_state(saved)
        correct = [sum(is_correct(x, run.rewards[0].name) for x in g.samples) for g in sampled]
        for k in sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n}):
            out[f"eval/pass@{k}"] = statistics.fmean(pass_at_k(n, c, k) for c in correct)
    return out


def sample_rows(step: int, groups: list[Group]) -> list[dict[str, Any]]:
    """One row per sample; "advantage" is what update_policy used (the token mean for gae).
    "masked" lists [start, end, reason] character spans of the completion whose tokens had loss
    mask 0 (today a whole completion: a reward excluded it, or it was truncated under
    algo.mask_truncated); the report's rollout browser marks them."""
    rows = []
    for g in groups:
        reasons = g.metadata.get("masked") or [None] * len(g.samples)
        injected = g.metadata.get("injected_spans") or [[] for _ in g.samples]
        texts = g.metadata.get("texts") or [s.completion.text for s in g.samples]  # an episode: all its segments
        for k, s in enumerate(g.samples):
            rows.append({
                "step": step, "prompt_id": g.metadata.get("id"), "prompt": g.prompt, "completion": texts[k],
                "reward": s.reward, "rewards": s.reward_parts,
                "advantage": g.metadata["advantages"][k] if "advantages" in g.metadata else None,
                "finish_reason": s.completion.finish_reason, "completion_tokens": len(s.completion.token_ids),
                "masked": [[0, len(texts[k]), reasons[k]]] if reasons[k] else
                [[a, b, "injected"] for a, b in injected[k]],
                **({"policy_version": s.completion.policy_version} if s.completion.policy_version is not None else {}),
                **({"swapped_at": list(s.completion.swapped_at)} if s.completion.swapped_at else {}),
                **({"expert": True} if s.off_policy else {})})
    return rows


def _state(run: Run) -> dict[str, Any]:
    state = {"learner": run.learner.state_dict(), "sampler": run.sampler.state_dict(),
             "engine_rng": run.engine.generator.get_state(), "update_rng": run.update_generator.get_state()}
    if run.kl is not None:
        state["kl"] = run.kl.state_dict()
    if run.loss_state:
        state["loss_state"] = dict(run.loss_state)
    if run.rehearsal is not None:
        state["rehearsal"] = run.rehearsal.state_dict()
    if run.critic is not None:
        state["critic"] = {"model": run.critic.model.state_dict(), "learner": run.critic.state_dict()}
    if run.replay is not None:
        state["replay"] = run.replay.state_dict()
    if run.relift is not None:
        state["relift"] = run.relift.state_dict()
    if run.ema is not None:
        state["ema"] = run.ema.state_dict()
    return state


def _restore(run: Run, state: dict[str, Any]) -> None:
    run.learner.load_state_dict(state["learner"])
    run.sampler.load_state_dict(state["sampler"])
    run.engine.generator.set_state(state["engine_rng"])
    run.update_generator.set_state(state["update_rng"])
    if run.kl is not None and "kl" in state:
        run.kl.load_state_dict(state["kl"])
    run.loss_state.update(state.get("loss_state", {}))
    if run.rehearsal is not None and "rehearsal" in state:
        run.rehearsal.load_state_dict(state["rehearsal"])
    if run.replay is not None and "replay" in state:
        run.replay.load_state_dict(state["replay"])
    if run.relift is not None and "relift" in state:
        run.relift.load_state_dict(state["relift"])
    if run.ema is not None and "ema" in state:
        run.ema.load_state_dict(state["ema"])
    if run.critic is not None:
        if "critic" not in state:
            raise RunDirError("this checkpoint has no critic (it was saved by a run without advantage = \"gae\")")
        run.critic.model.load_state_dict(state["critic"]["model"])
        run.critic.load_state_dict(state["critic"]["learner"])
    ckpt.restore_rng(state["rng"])
    if not run.shared_weights:
        run.engine.update_weights(merged_state_dict(run.learner.model))


def save(run: Run, step: int) -> Path:
    if run.pipeline is not None:  # the sampler and replay buffer are saved between collections
        run.pipeline.drain()
    return ckpt.save_checkpoint(run.dir, step, run.learner.model, run.tokenizer, _state(run),
                                keep=run.cfg.keep_checkpoints, resume_command=f"rlvr {run.command} --resume {run.dir}")


def create_run_dir(cfg: RunConfig, command: str = "train") -> Path:
    run_dir = Path(cfg.output_dir) / cfg.name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"run directory {run_dir} already exists; resume it with `rlvr {command} --resume {run_dir}` "
                          "or choose another name (name=...)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return run_dir


def train(cfg: RunConfig | None = None, *, resume: str | Path | None = None, overrides: tuple[str, ...] = (),
          quiet: bool = False) -> dict[str, Any]:
    """Run (or resume) a training job; returns the summary also written to summary.json."""
    run, start = open_run(cfg, resume=resume, overrides=overrides, quiet=quiet)
    cfg = run.cfg
    try:
        dist.attach(run)  # dist.rollout_workers / dist.learners: the same loop, parts on Ray
        d = cfg.dist
        if d.async_steps:
            from rlvr.dist.pipeline import Pipeline

            lookahead = min(d.async_steps, d.max_staleness) if d.on_stale == "wait" else d.async_steps
            run.pipeline = Pipeline(lambda step: collect(run, step), lookahead=lookahead, last_step=cfg.train.steps)
        return _train_loop(run, start, quiet)
    finally:
        dist.detach(run)


def open_run(cfg: RunConfig | None, *, resume: str | Path | None = None, overrides: tuple[str, ...] = (),
             quiet: bool = False, command: str = "train", optimizer_steps: int | None = None) -> tuple[Run, int]:
    """A new run (its directory created, removed again if setup fails) or a resumed one (restored
    from its latest checkpoint, its logs cut back to it); returns (run, the step it starts after).
    `optimizer_steps` sets the learning-rate schedule's length where it is not train.steps ×
    epochs × mini_batches (SFT, DPO)."""
    if resume is not None:
        run_dir = Path(resume)
        if not (run_dir / "config.toml").is_file():
            raise RunDirError(f"{run_dir} is not a run directory (no config.toml)")
        if any(o.split("=", 1)[0].strip() in ("model", "name", "output_dir") for o in overrides):
            raise RunDirError("model, name and output_dir belong to the run and cannot change on resume")
        cfg = load_config(run_dir / "config.toml", overrides)
        _require_sinks(cfg)
        last = ckpt.latest_checkpoint(run_dir)
        if last is None:
            raise RunDirError(f"{run_dir} has no complete checkpoint to resume from (it stopped while being "
                              "set up); start a new run, or delete this directory to reuse its name")
        run = setup(cfg, run_dir, model_spec=str(last), quiet=quiet, optimizer_steps=optimizer_steps)
        run.command = command
        state = ckpt.load_state(last)
        _restore(run, state)
        if overrides:  # e.g. train.steps=40 to extend a finished run; written once setup has worked
            (run_dir / "config.toml").write_text(to_toml(cfg))
        start = int(state["step"])
        for name in ("metrics.jsonl", "samples.jsonl"):
            ckpt.truncate_jsonl(run_dir / name, start)
        return run, start
    if cfg is None:
        raise ValueError(f"{command}() needs a config or resume=<run dir>")
    _require_sinks(cfg)
    run_dir = create_run_dir(cfg, command)
    try:
        run = setup(cfg, run_dir, quiet=quiet, optimizer_steps=optimizer_steps)
        run.command = command
        return run, 0
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-made is left behind
        raise


def _require_sinks(cfg: RunConfig) -> None:
    """Fail before any compute is spent when a configured tracker's package is missing."""
    for sink in cfg.log.sinks:
        tracking.require(sink)


class GracefulStop:
    """The first Ctrl-C asks the loop to stop after the current step and save a checkpoint (a step
    is never cut in half, so the saved state resumes exactly); a second Ctrl-C aborts at once."""

    def __init__(self, progress: ConsoleProgress) -> None:
        self.requested, self.progress = False, progress
        self._previous: Any = None

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.progress.print("stopping after this step and saving a checkpoint (Ctrl-C again to abort now)")

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)


class Interrupted(KeyboardInterrupt):
    """Training stopped on request after a checkpoint was saved."""


def stop_if_requested(run: Run, step: int, stop: GracefulStop, progress: ConsoleProgress) -> None:
    """After a step: on a first Ctrl-C, save it and stop, saying how to resume."""
    if stop.requested:
        save(run, step)
        progress.print(f"stopped: saved step {step}; resume with `rlvr {run.command} --resume {run.dir}`")
        raise Interrupted


def _train_loop(run: Run, start: int, quiet: bool) -> dict[str, Any]:
    cfg = run.cfg
    summary_path = run.dir / "summary.json"
    summary: dict[str, Any] = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    progress = ConsoleProgress(cfg.train.steps, start)
    if quiet:
        progress.console.quiet = True
    if start >= cfg.train.steps:
        progress.print(f"{run.dir} is complete at step {start}; raise train.steps to continue it")
        return summary
    trackers = tracking.open_trackers(cfg.log.sinks, run.dir, name=run.dir.name, config=cfg.model_dump(), start_step=start,
                             wandb_project=cfg.log.wandb_project, wandb_mode=cfg.log.wandb_mode,
                             mlflow_uri=cfg.log.mlflow_uri, mlflow_experiment=cfg.log.mlflow_experiment,
                             warn=progress.print)
    metrics_sink, samples_sink = JsonlSink(run.dir / "metrics.jsonl"), JsonlSink(run.dir / "samples.jsonl")
    try:
        with progress, GracefulStop(progress) as stop:
            if start == 0 and ckpt.latest_checkpoint(run.dir) is None:
                save(run, 0)  # a run that dies before its first checkpoint can still be resumed
            if start == 0 and "eval_before" not in summary:
                progress.status("evaluating (before)")
                summary["eval_before"] = evaluate(run)
                summary_path.write_text(json.dumps(summary, indent=2))
                trackers.log(0, summary["eval_before"])
            budget = cfg.train.max_minutes * 60 if cfg.train.max_minutes else None
            spent = sum(r.get("step_seconds") or 0.0 for r in read_jsonl(run.dir / "metrics.jsonl"))
            last = cfg.train.steps
            for step in range(start + 1, cfg.train.steps + 1):
                metrics, groups = train_step(run, step, progress)
                spent += metrics["step_seconds"]
                if cfg.train.eval_every and step % cfg.train.eval_every == 0:
                    progress.status("evaluating")
                    metrics |= evaluate(run, step)  # greedy on the held-out prompts, in this step's row
                metrics_sink.write(metrics)
                trackers.log(step, metrics)
                if step % cfg.samples_every == 0:
                    for row in sample_rows(step, groups):
                        samples_sink.write(row)
                progress.step(step, metrics)
                stop_if_requested(run, step, stop, progress)
                if budget is not None and spent >= budget and step < cfg.train.steps:
                    last = step
                    summary["stopped_by_budget"] = {"step": step, "minutes": spent / 60}
                    progress.print(f"train.max_minutes = {cfg.train.max_minutes} reached after step {step}")
                    break
                if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.train.steps:
                    progress.status("checkpointing")
                    save(run, step)
            save(run, last)
            progress.status("evaluating (after)")
            summary["eval_after"] = evaluate(run, last)
            trackers.log(last, summary["eval_after"])
    finally:
        metrics_sink.close()
        samples_sink.close()
        trackers.close()
    summary |= _summarise(run.dir / "metrics.jsonl", run.dir)
    summary_path.write_text(json.dumps(summary, indent=2))
    progress.print(summary_line(summary))
    if cfg.log.report:
        _write_report(run.dir, progress)
    return summary


def _write_report(run_dir: Path, progress: ConsoleProgress) -> None:
    """report.html and curves.png; a failure is reported, never fatal (the run's files are complete)."""
    from rlvr.report import write_report

    try:
        paths = write_report(run_dir)
    except Exception as e:  # noqa: BLE001 - the run itself succeeded
        progress.print(f"could not write the report ({type(e).__name__}: {e}); try `rlvr report {run_dir}`")
        return
    progress.print("report: " + "  ".join(str(p) for p in paths))


def _summarise(metrics_path: Path, run_dir: Path) -> dict[str, Any]:
    rows = read_jsonl(metrics_path)
    if not rows:
        return {"run_dir": str(run_dir), "steps": 0}
    k = max(1, min(3, len(rows) // 3))  # compare the mean of the first and last k steps
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)  # noqa: E731
    return {"run_dir": str(run_dir), "steps": rows[-1]["step"],
            "reward_start": mean(rows[:k], "reward"), "reward_end": mean(rows[-k:], "reward"),
            "seconds": sum(r["step_seconds"] for r in rows)}


def summary_line(summary: dict[str, Any]) -> str:
    """The one-line result: reward at start → end, held-out accuracy before → after, where the run is."""
    parts = []
    if "reward_start" in summary:
        parts.append(f"reward {summary['reward_start']:.3f} → {summary['reward_end']:.3f}")
    if "loss_start" in summary:  # rlvr sft, rlvr dpo
        parts.append(f"loss {summary['loss_start']:.3f} → {summary['loss_end']:.3f}")
    before, after = summary.get("eval_before", {}), summary.get("eval_after", {})
    if "eval/accuracy" in before and "eval/accuracy" in after:
        if before["eval/accuracy"] == after["eval/accuracy"] == 0 and "eval/reward" in before:
            # a reward that is not pass/fail (RLP's information gain): its mean says more
            parts.append(f"held-out reward {before['eval/reward']:.3f} → {after['eval/reward']:.3f}")
        else:
            parts.append(f"held-out accuracy {before['eval/accuracy']:.1%} → {after['eval/accuracy']:.1%}")
    parts.append(f"{summary.get('steps', 0)} steps in {summary.get('seconds', 0):.0f}s")
    parts.append(f"run: {summary.get('run_dir')}")
    return "done: " + " | ".join(parts)
