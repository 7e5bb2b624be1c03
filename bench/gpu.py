"""rlvr on a CUDA GPU: the engine's agreement with HF there, every method's update against the
same update on the CPU, and the engine's and the learner's speed on realistic shapes (random
weights of Qwen2 0.5B and 1.5B configs) against HF `generate` on the same GPU. Issue 20's GPU
checks; not a test: run by hand where a GPU is lent.

    python bench/gpu.py --out gpu.json                     # everything (a few minutes on an H100)
    python bench/gpu.py --parts graphs,engine --out x.json # some parts
    python bench/gpu.py --device cpu --smoke --out x.json  # the same code on tiny shapes, to check the script
    python bench/gpu.py make-model DIR --shape smollm2-135m --tokenizer TOKDIR --seed 1

Random weights serve speed (what runs is the same work as for trained weights), and the
agreement checks compare two computations of the same model. Each part's result (or its error)
is written to --out as soon as it is known, so a part that fails or a call cut short still
leaves the others' numbers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

# Shapes of public configs (config.json of each model), with random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192),
    "qwen2-0.5b": dict(model_type="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                       num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768),
    "qwen2-1.5b": dict(model_type="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                       num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=32768),
    # tiny, for the agreement checks and --smoke (a Qwen2 for its q/k/v biases, a Llama without)
    "tiny-llama": dict(model_type="llama", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False,
                       max_position_embeddings=1024),
    "tiny-qwen2": dict(model_type="qwen2", hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                       max_position_embeddings=1024),
}


def config_for(shape: str, **extra: Any) -> PretrainedConfig:
    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    return AutoConfig.for_model(model_type, bos_token_id=1, eos_token_id=2, pad_token_id=2, **fields, **extra)


def random_model(shape: str, dtype: torch.dtype, device: str, seed: int = 0, **extra: Any) -> Any:
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config_for(shape, **extra), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


class NoText:
    """The engine's tokenizer, for token ids that stand for no text (random weights)."""

    pad_token_id = 0

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        return ""


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (count, length), generator=gen).tolist()


# --- agreement --------------------------------------------------------------------------------

def part_agreement(device: str) -> dict[str, Any]:
    """Engine vs HF on the same fp32 model: the engine's log-prob of each token it sampled against
    a plain HF forward of the whole sequence (the learner/engine mismatch at its source), and
    greedy tokens of the static decoder (its steps replayed as CUDA graphs, and launched one by
    one) against the HF decoder's, prompts of unequal lengths."""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams

    out: dict[str, Any] = {}
    decoders = {"static": dict(decoder="static"), "static_eager": dict(decoder="static", cuda_graphs=False),
                "hf": dict(decoder="hf")}
    for shape in ("tiny-llama", "tiny-qwen2"):
        model = agreement_model(shape, device)
        prompts = [random_prompts(1, n, 512, seed=n)[0] for n in (5, 17, 9, 30)]
        row: dict[str, Any] = {}
        greedy: dict[str, list[list[int]]] = {}
        for name, kwargs in decoders.items():
            engine = EmbeddedEngine(model, NoText(), eos_token_ids=[], **kwargs)  # type: ignore[arg-type]
            sampled = engine.generate(prompts, SamplingParams(max_new_tokens=40, n=3))
            row[f"{name}_logprob_max_abs_diff"] = max(logprob_gap(model, prompt, c, device)
                                                      for prompt, group in zip(prompts, sampled) for c in group)
            done = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40, n=1))
            greedy[name] = [list(g[0].token_ids) for g in done]
        for name in ("static", "static_eager"):
            same = sum(a == b for s, h in zip(greedy[name], greedy["hf"]) for a, b in zip(s, h))
            row[f"{name}_greedy_tokens_equal_hf"] = f"{same}/{sum(len(s) for s in greedy[name])}"
        out[shape] = row
    return out


def logprob_gap(model: Any, prompt: list[int], completion: Any, device: str) -> float:
    """The largest difference between the engine's log-prob of a sampled token and a plain HF
    forward's over the whole sequence (no cache, no padding)."""
    ids = torch.tensor([prompt + list(completion.token_ids)], device=device)
    with torch.no_grad():
        logp = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)
    ref = logp.gather(-1, ids[0, len(prompt):, None]).squeeze(-1)
    return (ref - torch.tensor(completion.logprobs, device=device)).abs().max().item()


def part_prefixes(device: str) -> dict[str, Any]:
    """Multi-turn prefix reuse on the device: three turns inside `reusing_prefixes`, each turn's
    prompts the last turn's plus its sampled action and an observation, prompts sharing a prefix
    in groups. Every sampled token's log-prob against a plain HF forward of the whole sequence,
    and each turn's reused prefill against a whole one (static decoder, graphs on a GPU)."""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams

    out: dict[str, Any] = {}
    for shape in ("tiny-llama", "tiny-qwen2"):
        model = agreement_model(shape, device)
        engine = EmbeddedEngine(model, NoText(), eos_token_ids=[], decoder="static", seed=3)  # type: ignore[arg-type]
        system = random_prompts(1, 24, 512, seed=99)[0]
        prompts = [system + q for q in random_prompts(4, 7, 512, seed=5)]
        params = SamplingParams(temperature=1.0, max_new_tokens=12, n=1)
        worst_logprob, worst_prefill = 0.0, 0.0
        encoded: list[int] = []
        with engine.reusing_prefixes():
            for turn in range(3):
                if turn:
                    forward = model.forward

                    def counting(*args: Any, **kwargs: Any) -> Any:  # tokens the reused prefill encodes
                        encoded.append(int(kwargs["input_ids"].numel()))
                        return forward(*args, **kwargs)

                    model.forward = counting
                    try:
                        _, reused, _, _ = engine._prefill(prompts)
                    finally:
                        del model.forward
                    whole = engine._prefill_whole(prompts)[1]
                    worst_prefill = max(worst_prefill, (reused - whole).abs().max().item())
                groups = engine.generate(prompts, params)
                worst_logprob = max(worst_logprob, *(logprob_gap(model, p, g[0], device) for p, g in zip(prompts, groups)))
                prompts = [p + list(g[0].token_ids) + random_prompts(1, 3 + i, 512, seed=turn * 10 + i)[0]
                           for i, (p, g) in enumerate(zip(prompts, groups))]
        out[shape] = {"logprob_max_abs_diff": worst_logprob, "reused_vs_whole_prefill_logits_max_abs_diff": worst_prefill,
                      "final_context_tokens": [len(p) for p in prompts],
                      "tokens_encoded_by_reused_prefills": sum(encoded)}
    return out


def agreement_model(shape: str, device: str) -> Any:
    # initializer_range 0.2: peaked distributions, so greedy ties (equal to rounding) are rare
    model = random_model(shape, torch.float32, device, seed=1, initializer_range=0.2)
    if shape == "tiny-qwen2":  # non-zero q/k/v biases, which the static decoder adds itself
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    return model


def part_graphs(device: str) -> dict[str, Any]:
    """The static decoder with CUDA graphs against the same decoder launching kernel by kernel,
    through every layout: samples end at EOS at different steps (compactions, each re-captured),
    run past `GROW` columns (a growth), with prompts shared and joined (`SHARE_FROM` 0 and the
    default). Same seeds, fp32: the sampled tokens must be the same, and their log-probs equal to
    rounding. (Its seconds are the correctness run's, the graphs' including every capture; the
    `engine` part measures speed.)"""
    from rlvr.rollout import static_decode
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams

    out: dict[str, Any] = {}
    default_share = static_decode.SHARE_FROM
    for shape in ("tiny-llama", "tiny-qwen2"):
        model = agreement_model(shape, device)
        prompts = [random_prompts(1, n, 512, seed=n)[0] for n in (5, 17, 9, 30, 12, 3)]
        for share in (0, default_share):
            static_decode.SHARE_FROM = share
            try:
                runs: dict[bool, Any] = {}
                captures = 0
                seconds: dict[bool, float] = {}
                for graphs in (True, False):
                    engine = EmbeddedEngine(model, NoText(), eos_token_ids=list(range(3, 10)),  # type: ignore[arg-type]
                                            decoder="static", seed=7)
                    # set after construction, which turns it off on a CPU: there (--smoke) the fixed-shape
                    # steps run without capture
                    engine.cuda_graphs = graphs
                    start = time.perf_counter()
                    runs[graphs] = engine.generate(prompts, SamplingParams(max_new_tokens=150, n=4))
                    seconds[graphs] = time.perf_counter() - start
                    if graphs and engine._graphs is not None:
                        captures = engine._graphs.captures
            finally:
                static_decode.SHARE_FROM = default_share
            pairs = [(a, b) for ga, gb in zip(runs[True], runs[False]) for a, b in zip(ga, gb)]
            lengths = [len(a.token_ids) for a, _ in pairs]
            worst = max(max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) for a, b in pairs)
            out[f"{shape}/share_from_{share}"] = {
                "same_tokens": f"{sum(a.token_ids == b.token_ids for a, b in pairs)}/{len(pairs)}",
                "logprob_max_abs_diff": worst, "lengths_min_max": [min(lengths), max(lengths)],
                "seconds_graphs_eager": [round(seconds[True], 2), round(seconds[False], 2)], "captures": captures}
    return out


# --- every method on the device ---------------------------------------------------------------

def _nested(**flat: Any) -> Any:
    """UpdateSettings from method_settings' flat keys (the config's names: loss, kl_coef, ...)."""
    from rlvr.train.settings import AdvantageSettings, KLSettings, LossSettings, Passes, UpdateSettings

    parts: dict[str, dict[str, Any]] = {"advantage": {}, "loss": {}, "kl": {}, "passes": {}, "": {}}
    where = {"advantage": ("advantage", "name"), "loss": ("loss", "name"), "offpolicy": ("loss", "offpolicy"),
             "offpolicy_kwargs": ("loss", "offpolicy_kwargs"), "aggregation": ("loss", "aggregation"),
             "max_tokens": ("loss", "max_tokens"), "entropy_top": ("loss", "entropy_top"),
             "entropy_coef": ("loss", "entropy_coef"), "kl_coef": ("kl", "coef"), "kl_placement": ("kl", "placement"),
             "micro_batch_size": ("passes", "micro_batch_size"), "share_prompts": ("passes", "share_prompts"),
             "mini_batches": ("", "mini_batches"), "epochs": ("", "epochs")}
    for key, value in flat.items():
        part, name = where[key]
        parts[part][name] = value
    return UpdateSettings(advantage=AdvantageSettings(**parts["advantage"]), loss=LossSettings(**parts["loss"]),
                          kl=KLSettings(**parts["kl"]), passes=Passes(**parts["passes"]), **parts[""])


def method_settings() -> dict[str, dict[str, Any]]:
    """One update setting per loss, off-policy correction, outcome estimator and aggregation,
    plus the KL placements and the entropy options: the update's seams, each exercised once.
    Keys starting with "_" are not UpdateSettings: "_groups" picks the input ("mixed": a replayed
    group and a demonstration in each group, as `sampler.replay` and LUFFY give), "_teacher" adds
    on-policy distillation's credit, "_critic" PPO's (GAE), "_optimizer" the learner's optimizer,
    "_dtype" the model's (bf16: both sides round differently, so expect ~1e-2, not fp32's ~1e-5)."""
    from rlvr.algos.aggregation import AGGREGATIONS
    from rlvr.algos.advantages import ESTIMATORS
    from rlvr.algos.losses import LOSSES
    from rlvr.algos.offpolicy import CORRECTIONS

    out: dict[str, dict[str, Any]] = {f"loss={n}": {"loss": n} for n in LOSSES}
    # a correction's required keywords; geo_mask's ±0.1% would mask every row of noise 0.1 nats
    needs = {"opsm": {"delta": 0.05}, "geo_mask": {"low": 0.97, "high": 1.03}}
    out |= {f"offpolicy={n}": {"offpolicy": n, "offpolicy_kwargs": needs.get(n, {})} for n in CORRECTIONS if n != "none"}
    # remax reads each group's greedy reward and stratified its examples' strata: not in random groups
    out |= {f"advantage={n}": {"advantage": n} for n in ESTIMATORS if n not in ("grpo", "remax", "stratified")}
    out |= {f"aggregation={n}": {"aggregation": n} for n in AGGREGATIONS if n != "token-mean"}
    out |= {"kl=loss": {"kl_coef": 0.1, "kl_placement": "loss"}, "kl=reward": {"kl_coef": 0.1, "kl_placement": "reward"},
            "entropy_top=0.2": {"entropy_top": 0.2}, "entropy_coef=0.01": {"entropy_coef": 0.01},
            "share_prompts=False": {"share_prompts": False},
            "replayed+demonstrations": {"_groups": "mixed"},
            "replayed+demonstrations,loss=luffy": {"_groups": "mixed", "loss": "luffy"},
            "opd": {"_teacher": True, "advantage": "opd"},
            "opd,kl=reward": {"_teacher": True, "advantage": "opd", "kl_coef": 0.1, "kl_placement": "reward"},
            "gae": {"_critic": True, "advantage": "gae"},
            "gae,kl=reward": {"_critic": True, "advantage": "gae", "kl_coef": 0.1, "kl_placement": "reward"},
            "optimizer=adamw_compact": {"_optimizer": "adamw_compact"},
            "bf16": {"_dtype": torch.bfloat16}}
    return out


def method_groups(model: Any, mixed: bool) -> list[Any]:
    """Random groups whose sampler log-probs are the model's own (fp32, CPU) plus noise of 0.1
    nats, so that importance weights and masks act, each sample's reward its one reward part
    (correct = 1, as NFT reads it); ``mixed``: the first group replayed and the
    last sample of every group a demonstration."""
    import dataclasses

    from rlvr.bench import fake_groups

    groups = fake_groups(16, 8, 12, 10, model.config.vocab_size)
    gen = torch.Generator().manual_seed(1)
    out = []
    for g_i, g in enumerate(groups):
        samples = []
        for k, x in enumerate(g.samples):
            ids = torch.tensor([list(x.prompt_ids + x.completion.token_ids)])
            with torch.no_grad():
                logp = model(input_ids=ids).logits[0, len(x.prompt_ids) - 1 : -1].float().log_softmax(-1)
            own = logp.gather(-1, ids[0, len(x.prompt_ids):, None]).squeeze(-1)
            noisy = (own + 0.1 * torch.randn(own.shape, generator=gen)).clamp(max=0.0)
            c = dataclasses.replace(x.completion, logprobs=tuple(noisy.tolist()))
            samples.append(dataclasses.replace(x, completion=c, off_policy=mixed and k == len(g.samples) - 1,
                                               reward_parts={"reward": x.reward}))  # NFT reads correctness
        out.append(dataclasses.replace(g, samples=tuple(samples), replay_age=1 if mixed and g_i == 0 else None))
    return out


def part_methods(device: str) -> dict[str, Any]:
    """Each setting of `method_settings` as one fp32 update (two mini-batches, so the second runs
    off-policy) of the same tiny model on the CPU and on `device`, with the same mini-batch order
    and the global generator reseeded alike (Clip-Cov draws from it): an error on one side only is
    a device bug; otherwise the largest relative difference of the update's metrics (NaN counts
    as a difference; a metric on one side only is reported) and of the parameter change."""
    import copy
    import math

    from rlvr.algos.distill import OpdOptions
    from rlvr.train.learner import Learner
    from rlvr.options import GaeOptions
    from rlvr.train.critic import Critic
    from rlvr.train.methods.distill import TeacherCredit
    from rlvr.train.methods.ppo import CriticCredit
    from rlvr.train.update import UpdateSettings, update_policy

    base = random_model("tiny-llama", torch.float32, "cpu", seed=3)
    teacher = random_model("tiny-llama", torch.float32, "cpu", seed=4)
    inputs = {mixed: method_groups(base, mixed) for mixed in (False, True)}
    results: dict[str, Any] = {}
    for label, extra in method_settings().items():
        options = {k: v for k, v in extra.items() if not k.startswith("_")}
        groups = inputs[extra.get("_groups") == "mixed"]
        sides: dict[str, Any] = {}
        for where in ("cpu", device):
            torch.manual_seed(0)
            model = copy.deepcopy(base).to(where, extra.get("_dtype", torch.float32)).train()
            before = [p.detach().clone() for p in model.parameters()]
            try:
                # the reference: another model, so that the KL is not zero
                ref = copy.deepcopy(teacher).to(where).eval() if options.get("kl_coef") else None
                credit: TeacherCredit | CriticCredit | None = None
                if extra.get("_teacher"):
                    credit = TeacherCredit(copy.deepcopy(teacher).to(where), OpdOptions(teacher="in memory"))
                if extra.get("_critic"):
                    critic = Learner(Critic(copy.deepcopy(model)).to(where), lr=1e-3)
                    credit = CriticCredit(critic, GaeOptions())
                settings = _nested(micro_batch_size=4, mini_batches=2, max_tokens=10, **options)
                learner = Learner(model, lr=1e-3, optimizer=extra.get("_optimizer", "adamw"))
                res = update_policy(learner, groups, settings, pad_token_id=0, ref_model=ref,
                                    credit=credit, generator=torch.Generator().manual_seed(0))
                delta = torch.cat([(p.detach() - b).flatten().float().cpu() for p, b in zip(model.parameters(), before)])
                sides[where] = (res.metrics, delta)
            except Exception as e:  # noqa: BLE001 - recorded per side
                sides[where] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        cpu, dev = sides["cpu"], sides[device]
        if isinstance(cpu, str) or isinstance(dev, str):
            results[label] = {"cpu": cpu if isinstance(cpu, str) else "ok", "device": dev if isinstance(dev, str) else "ok"}
            continue

        def rel(k: str) -> float:
            a, b = cpu[0][k], dev[0][k]
            return 0.0 if a == b else abs(a - b) / max(abs(a), 1e-6) if math.isfinite(a - b) else math.inf

        keys = [k for k in cpu[0] if isinstance(cpu[0][k], float) and k in dev[0]]
        worst = max(keys, key=rel)
        results[label] = {"metric_rel_diff": rel(worst), "worst_metric": worst, "loss_cpu": cpu[0].get("loss"),
                          "loss_device": dev[0].get("loss"), "param_change_norm": float(cpu[1].norm()),
                          "one_side_metrics": sorted(set(cpu[0]) ^ set(dev[0])),
                          "delta_rel_diff": float((cpu[1] - dev[1]).norm() / cpu[1].norm().clamp(min=1e-30))}
    return results


# --- engine speed -----------------------------------------------------------------------------

def part_engine(device: str, shape: str, batches: list[int], prompt: int, new_tokens: int,
                dtype: torch.dtype, decoders: tuple[str, ...] = ("static", "static_eager")) -> dict[str, Any]:
    """Decode tokens/s of the engine's static decoder (its steps replayed as CUDA graphs, and
    launched one by one) and of HF `generate`, every row forced to `new_tokens` (no EOS),
    G = min(8, batch) samples per prompt as in GRPO. Each is timed on its first call after a
    4-token warm-up and on a repeat of the same call (``*_repeat``): a first call meets every key
    length for the first time, which costs where attention builds a plan per shape (cuDNN's;
    docs/LOG.md, session 20). (The engine's HF decoder, 2.4-3.9× slower than the static one on
    the H200 in session 9, is no longer timed here.)"""
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams

    model = random_model(shape, dtype, device)
    vocab = model.config.vocab_size
    rows = []
    for batch in batches:
        group = min(8, batch)
        ids = random_prompts(batch // group, prompt, vocab, seed=batch)
        row: dict[str, Any] = {"batch": batch}
        for name, graphs in (("static", True), ("static_eager", False)):
            if name not in decoders:
                continue
            engine = EmbeddedEngine(model, NoText(), eos_token_ids=[], max_batch_size=batch,  # type: ignore[arg-type]
                                    decoder="static", cuda_graphs=graphs)
            engine.generate(ids, SamplingParams(max_new_tokens=4, n=group))  # warm-up at this shape
            for key in (f"rlvr_{name}_tok_s", f"rlvr_{name}_repeat_tok_s"):
                row[key] = timed(lambda: engine.generate(ids, SamplingParams(max_new_tokens=new_tokens, n=group)),
                                 batch * new_tokens, device)
        input_ids = torch.tensor([p for p in ids for _ in range(group)], device=device)
        kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=True, top_k=0,
                      top_p=1.0, temperature=1.0, pad_token_id=0)
        model.generate(**kwargs, max_new_tokens=4, min_new_tokens=4)  # warm-up
        for key in ("hf_generate_tok_s", "hf_generate_repeat_tok_s"):
            row[key] = timed(lambda: model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens),
                             batch * new_tokens, device)
        for name in decoders:
            row[f"{name}_vs_hf_generate"] = round(row[f"rlvr_{name}_tok_s"] / row["hf_generate_tok_s"], 2)
            row[f"{name}_vs_hf_generate_repeat"] = round(row[f"rlvr_{name}_repeat_tok_s"] / row["hf_generate_repeat_tok_s"], 2)
        if len(decoders) == 2:
            row["graphs_vs_eager"] = round(row["rlvr_static_tok_s"] / row["rlvr_static_eager_tok_s"], 2)
        rows.append(row)
        print(f"  engine {shape} {row}", flush=True)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"shape": shape, "parameters": params, "dtype": str(dtype), "prompt": prompt,
            "new_tokens": new_tokens, "rows": rows}


def timed(call: Callable[[], Any], tokens: int, device: str) -> float:
    """Tokens/s of one `call` that makes `tokens` tokens."""
    sync(device)
    start = time.perf_counter()
    call()
    sync(device)
    return round(tokens / (time.perf_counter() - start), 1)


# --- learner speed ----------------------------------------------------------------------------

def matmul_tflops(device: str, dtype: torch.dtype, m: int, k: int, n: int, seconds: float = 0.2) -> float:
    """The rate of an [m, k] @ [k, n] product, timed over at least `seconds` (a product of these
    shapes takes microseconds on a GPU: a few dozen would time the clock, not the product)."""
    a, b = torch.randn(m, k, dtype=dtype, device=device), torch.randn(k, n, dtype=dtype, device=device)
    for _ in range(3):
        a @ b
    sync(device)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(20):
            a @ b
        reps += 20
        sync(device)
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e12


def part_learner(device: str, shape: str, batch: int, prompt: int, completion: int, micro_batch: int,
                 dtype: torch.dtype, share_prompts: bool) -> dict[str, Any]:
    """One GRPO update (`update_policy`, AdamW) of `batch` samples in groups of 8: tokens/s, the
    achieved TFLOP/s at 6 × parameters per token run, against a matrix product of the model's
    MLP shape in the same process, and peak GPU memory. 6N counts the tied head on prompt
    tokens too, which it never runs on (a few % over), and no attention (a few % under). No token
    cap per micro-batch (`rlvr train`'s default caps it at 1024: `train.micro_batch_tokens`)."""
    from rlvr.bench import fake_groups, tokens_run
    from rlvr.train.learner import Learner
    from rlvr.train.settings import LossSettings, Passes
    from rlvr.train.update import UpdateSettings, update_policy

    model = random_model(shape, dtype, device)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    learner = Learner(model, lr=1e-6)
    groups = fake_groups(batch, min(8, batch), prompt, completion, model.config.vocab_size)
    settings = UpdateSettings(loss=LossSettings(max_tokens=completion),
                              passes=Passes(micro_batch_size=micro_batch, share_prompts=share_prompts))
    update_policy(learner, groups, settings, pad_token_id=0)  # warm-up: allocator, kernel choice
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    sync(device)
    start = time.perf_counter()
    update_policy(learner, groups, settings, pad_token_id=0)
    sync(device)
    seconds = time.perf_counter() - start
    run_tokens, shared = tokens_run(groups, micro_batch, None, share_prompts)
    achieved = 6 * params * run_tokens / seconds / 1e12
    cfg = model.config
    ceiling = matmul_tflops(device, dtype, micro_batch * (prompt + completion), cfg.hidden_size, cfg.intermediate_size)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else None
    del model, learner
    return {"shape": shape, "parameters": params, "dtype": str(dtype), "batch": batch, "prompt": prompt,
            "completion": completion, "micro_batch": micro_batch, "shared_prompts": shared,
            "tokens": batch * (prompt + completion), "tokens_run": run_tokens, "seconds": round(seconds, 3),
            "tokens_per_s": round(batch * (prompt + completion) / seconds, 1), "tflops": round(achieved, 1),
            "matmul_tflops": round(ceiling, 1), "fraction_of_matmul": round(achieved / ceiling, 3),
            "peak_gpu_memory_gib": None if peak is None else round(peak, 2)}


# --- a model folder for `rlvr train` ----------------------------------------------------------

def make_model(folder: str, shape: str, tokenizer: str, seed: int) -> None:
    """A random-weight model folder `rlvr train` loads like any checkpoint, with a real tokenizer's
    files copied beside it (its vocabulary must be the shape's)."""
    import shutil

    model = random_model(shape, torch.float32, "cpu", seed=seed)
    model.save_pretrained(folder)
    for f in Path(tokenizer).iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            shutil.copy(f, Path(folder) / f.name)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-model"]:
        mp = argparse.ArgumentParser(prog="gpu.py make-model")
        mp.add_argument("folder")
        mp.add_argument("--shape", default="smollm2-135m", choices=sorted(SHAPES))
        mp.add_argument("--tokenizer", required=True, help="a folder holding tokenizer.json and its config")
        mp.add_argument("--seed", type=int, default=0)
        margs = mp.parse_args(argv[1:])
        make_model(margs.folder, margs.shape, margs.tokenizer, margs.seed)
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and sizes: checks the script, measures nothing")
    ap.add_argument("--parts", default="agreement,graphs,prefixes,methods,engine,learner")
    ap.add_argument("--decoders", default="static,static_eager",
                    help="the engine part's: static (CUDA graphs) and/or static_eager (kernel by kernel)")
    ap.add_argument("--shapes", default="", help="the engine part's shapes, comma-separated (default: all)")
    args = ap.parse_args(argv)
    if set(args.decoders.split(",")) - {"static", "static_eager"}:
        ap.error(f"--decoders: static and/or static_eager, not {args.decoders!r}")
    dev, bf16 = args.device, torch.bfloat16
    result: dict[str, Any] = {"torch": torch.__version__, "device": dev, "python": sys.version.split()[0]}
    if dev.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        result["gpu"] = {"name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                         "multiprocessors": props.multi_processor_count}
    import transformers

    result["transformers"] = transformers.__version__
    if args.smoke:
        engines = [("tiny-qwen2", [1, 8], 8, 8)]
        learners = [("tiny-llama", 16, 8, 16, 8)]
    else:
        engines = [("smollm2-135m", [1, 8, 64], 64, 128), ("qwen2-0.5b", [1, 8, 64, 256], 64, 128),
                   ("qwen2-1.5b", [1, 64], 64, 128)]
        learners = [("smollm2-135m", 64, 64, 192, 16), ("qwen2-0.5b", 64, 64, 192, 16),
                    ("qwen2-0.5b", 64, 64, 192, 64), ("qwen2-1.5b", 64, 64, 192, 16)]
    jobs: list[tuple[str, Callable[[], dict[str, Any]]]] = []
    parts = args.parts.split(",")
    if "agreement" in parts:
        jobs.append(("agreement", partial(part_agreement, dev)))
    if "graphs" in parts:
        jobs.append(("graphs", partial(part_graphs, dev)))
    if "prefixes" in parts:
        jobs.append(("prefixes", partial(part_prefixes, dev)))
    if "methods" in parts and dev != "cpu":  # CPU against itself says nothing
        jobs.append(("methods", partial(part_methods, dev)))
    if "engine" in parts:
        for shape, batches, prompt, new in engines:
            if not args.shapes or shape in args.shapes.split(","):
                jobs.append((f"engine/{shape}", partial(part_engine, dev, shape, batches, prompt, new, bf16,
                                                        tuple(args.decoders.split(",")))))
    if "learner" in parts:
        for shape, batch, prompt, completion, micro in learners:
            for share in (True, False):
                jobs.append((f"learner/{shape}/mb{micro}/{'shared' if share else 'per-sample'}",
                             partial(part_learner, dev, shape, batch, prompt, completion, micro, bf16, share)))
    for name, job in jobs:
        start = time.perf_counter()
        try:
            result[name] = job()
        except Exception:  # keep the other parts' numbers; say what broke
            result[name] = {"error": traceback.format_exc(limit=6)}
        result[name]["wall_s"] = round(time.perf_counter() - start, 1)
        print(f"{name}: {json.dumps(result[name])}", flush=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
        if dev.startswith("cuda"):
            torch.cuda.empty_cache()
    summarize(result)


def summarize(result: dict[str, Any]) -> None:
    """The figures that matter, one line each (the call's output tail carries them back)."""
    print("\n== summary", result.get("gpu", result["device"]), "torch", result["torch"])
    for name, part in result.items():
        if not isinstance(part, dict) or name == "gpu":
            continue
        if "error" in part:
            print(f"{name}: ERROR {part['error'].strip().splitlines()[-1]}")
        elif name.startswith("engine/"):
            for r in part["rows"]:
                print(f"{name} b{r['batch']}: " + ", ".join(f"{k.removeprefix('rlvr_')} {v}" for k, v in r.items()
                                                            if k != "batch"))
        elif name.startswith("learner/"):
            print(f"{name}: {part['tokens_per_s']} tok/s, {part['tflops']} TFLOP/s = {part['fraction_of_matmul']} "
                  f"of {part['matmul_tflops']}, peak {part['peak_gpu_memory_gib']} GiB, {part['seconds']} s")
        elif name == "methods":
            for label, r in part.items():
                if not isinstance(r, dict):
                    continue
                if "cpu" in r:
                    flag = "DEVICE-ONLY FAILURE" if r["cpu"] == "ok" else "fails on both"
                    print(f"methods {label}: {flag}: cpu {r['cpu']} | device {r['device']}")
                else:
                    print(f"methods {label}: metrics rel diff {r['metric_rel_diff']:.1e} ({r['worst_metric']}), "
                          f"param change {r['param_change_norm']:.1e}, rel diff {r['delta_rel_diff']:.1e}"
                          + (f", on one side only: {r['one_side_metrics']}" if r["one_side_metrics"] else ""))
        else:
            print(f"{name}: {json.dumps(part)}")


if __name__ == "__main__":
    main()
