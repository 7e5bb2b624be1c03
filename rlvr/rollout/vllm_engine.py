"""The `Engine` protocol on vLLM, for GPUs: a thin layer over vLLM's documented offline API.

    generate        vllm.LLM.generate on token-id prompts (TokensPrompt), n samples per prompt,
                    with the log-probability of every sampled token under the distribution it was
                    sampled from: vLLM's ``logprobs_mode = "processed_logprobs"`` (after
                    temperature, top-k and top-p), which is what rlvr's losses take as the
                    behaviour policy's log-probs (rlvr.types.Completion).
    update_weights  new policy weights without a restart: every worker loads them through
                    ``LLM.collective_rpc`` into ``model.load_weights`` (the mechanism of vLLM's
                    RLHF examples), by the Hugging Face parameter names rlvr's learner uses.
    sleep / wake_up vLLM's sleep mode, to free the GPU for a colocated learner between rollouts
                    (``enable_sleep_mode=True``).

The weights travel as CPU tensors through vLLM's RPC, which is simple and correct for one GPU
and models of a few billion parameters. Larger models want CUDA-IPC or NCCL broadcast (vLLM's
``rlhf_colocate`` and ``rlhf`` examples), which fit behind the same `update_weights`.

Seeds: like the embedded engine, each call draws its seeds from the engine's ``generator`` (a
torch.Generator, checkpointed with the run), one per request, so the same engine seed gives the
same samples and a later call samples afresh.

This machine has no GPU: the engine contract tests (tests/test_engine_contract.py) run every
engine through the same checks and skip vLLM, saying so, where CUDA or vllm is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from rlvr.rollout.engine import draw_seeds
from rlvr.types import Completion, FinishReason, PromptMedia, SamplingParams

INSTALL_HINT = "pip install vllm   (needs a CUDA GPU)"


class WorkerWeights:
    """vLLM worker extension (``worker_extension_cls``): loads named tensors into the model."""

    def rlvr_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]
        device = next(model.parameters()).device
        model.load_weights(weights=[(name, tensor.to(device)) for name, tensor in weights])
        return len(weights)


class VLLMEngine:
    """Rollouts on vLLM (see module docstring). ``model`` is a local folder or a Hugging Face id
    of the policy's initial weights; ``llm_kwargs`` go to ``vllm.LLM`` (``gpu_memory_utilization``,
    ``tensor_parallel_size``, ``max_model_len``, ``enforce_eager``, ...)."""

    def __init__(self, model: str, tokenizer: Any, *, eos_token_ids: Iterable[int], seed: int = 0,
                 dtype: str = "auto", enable_sleep_mode: bool = False, banned_token_ids: Iterable[int] = (),
                 **llm_kwargs: Any) -> None:
        if not torch.cuda.is_available():
            raise ValueError("engine.backend = \"vllm\" needs a CUDA GPU, and this machine has none "
                             "(the embedded engine runs anywhere: engine.backend = \"embedded\")")
        from rlvr.log.tracking import import_extra

        vllm = import_extra("vllm", f"engine.backend = \"vllm\" needs vLLM: {INSTALL_HINT}")
        self.llm = vllm.LLM(model=model, tokenizer=model, dtype=dtype, seed=seed, logprobs_mode="processed_logprobs",
                            enable_sleep_mode=enable_sleep_mode,
                            worker_extension_cls=f"{__name__}.WorkerWeights", **llm_kwargs)
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
        share the stream of ``seeds[i][0]``. A prompt's images (``media[i].images``) go in as
        vLLM's multimodal data beside its token ids; the ids already hold the processor's
        expanded image tokens, which vLLM's multimodal processor detects as applied (its "prompt
        update detection", docs.vllm.ai, design/mm_processing) instead of expanding them again."""
        import vllm
        from vllm.inputs import TokensPrompt

        if any(len(p) == 0 for p in prompts):
            raise ValueError("cannot generate from an empty prompt")
        greedy = params.temperature == 0
        if seeds is None:
            seeds = draw_seeds(self.generator, len(prompts), params)
        requests = [vllm.SamplingParams(
            n=params.n, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k if params.top_k > 0 else -1,
            max_tokens=params.max_new_tokens, stop=list(params.stop) or None, stop_token_ids=self.eos_token_ids,
            logprobs=0, seed=None if greedy else seeds[k][0] % (2**31 - 1), skip_special_tokens=True,
            include_stop_str_in_output=True, ignore_eos=False, logit_bias=self.banned or None)
            for k in range(len(prompts))]
        if media is not None and len(media) != len(prompts):
            raise ValueError(f"media must give one entry (or None) per prompt: {len(media)} for {len(prompts)} prompts")
        inputs = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        for prompt, m in zip(inputs, media or ()):
            if m is not None:
                prompt["multi_modal_data"] = {"image": list(m.images) if len(m.images) > 1 else m.images[0]}
        outputs = self.llm.generate(inputs, requests, use_tqdm=False)
        groups = [[self._completion(o) for o in out.outputs] for out in outputs]
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
        weights = [(name, tensor.detach().cpu()) for name, tensor in state_dict.items()]
        self.llm.collective_rpc("rlvr_load_weights", args=(weights,))
        self.llm.reset_prefix_cache()  # cached prefixes were computed by the old weights

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass

    def sleep(self, level: int = 1) -> None:
        """Free the GPU memory of the weights (level 1 keeps them on the CPU) and the KV cache."""
        self.llm.sleep(level=level)

    def wake_up(self) -> None:
        self.llm.wake_up()
