"""`rlvr eval`: sample n completions per held-out prompt from each model, with the same prompts,
rewards and sampling settings, and report pass@k, maj@k, avg@k, length, entropy and diversity."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rlvr.config import RunConfig
from rlvr.eval.metrics import Z95, avg_at_k, distinct_n, maj_at_k, mean_and_se, paired_difference, pass_at_k
from rlvr.rewards import build_rewards, extract_answer
from rlvr.rewards.combine import score_group
from rlvr.types import SamplingParams
from rlvr.data import render_example, render_prompt
from rlvr.models import context_length, eos_token_ids, load_policy, resolve_dtype, resolve_model
from rlvr.rollout.build import make_engine
from rlvr.rollout.weights import decode_weights
from rlvr.data.images import image_token_ids
from rlvr.train.data import load_examples, prompts_fit, render_with_processor
from rlvr.train.rollouts import generate_groups
from rlvr.train.batches import score_certainty
from rlvr.train.rollouts import is_correct, judged, judged_by

if TYPE_CHECKING:
    from rlvr.data import Example
    from rlvr.rewards import RewardFn
    from rlvr.types import Group


def evaluate_model(model_spec: str, cfg: RunConfig, *, n: int, ks: list[int], prompts: int,
                   temperature: float, max_new_tokens: int, seed: int = 0,
                   cot_judge: dict[str, Any] | None = None, stage: Callable[..., None] | None = None,
                   progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Metrics of one model on the config's held-out prompts (the first `prompts` of them).

    ``cot_judge`` (a reward spec, e.g. {"fn": "llm_judge", "kwargs": {...}} or {"fn":
    "mypkg:judge"}) adds CoT-pass@k: pass@k where a sample counts only if its answer is correct
    and the judge also scores its reasoning >= 0.5 (Wen et al., "Reinforcement Learning with
    Verifiable Rewards Implicitly Incentivizes Correct Reasoning in Base LLMs", arXiv:2506.14245).
    Only samples with a correct answer are sent to the judge. ``stage(text, total=None)`` is
    told what it does, and ``progress(k)`` as k more prompts are sampled (rlvr.commands.progress)."""

    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"k = {bad[0]} needs n >= k samples per prompt (n = {n})")
    say = stage or (lambda text, total=None: None)
    say(f"loading {model_spec}")
    path = resolve_model(model_spec)
    model, tokenizer, processor = load_policy(path, resolve_dtype("auto"))
    model.eval()
    # on vLLM (engine.backend, engine.vllm_kwargs) the samples; the entropies below on `model`
    engine = make_engine(cfg.engine.backend, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                         dtype=next(model.parameters()).dtype, model=model, spec=path, seed=seed,
                         banned_token_ids=image_token_ids(processor), weights=decode_weights(cfg.engine.dtype),
                         vllm_kwargs=cfg.engine.vllm_kwargs)
    _, held = load_examples(cfg)
    held = held[:prompts]
    if not held:
        raise ValueError("no held-out prompts: set task.eval_size > 0")
    media = None
    if processor is not None:  # a vision-language model: prompts with images carry their pixel inputs
        ids, media = render_with_processor(processor, held, cfg.task.system_prompt)
    else:
        ids = [render_example(tokenizer, ex, cfg.task.system_prompt) for ex in held]
    prompts_fit("held-out", held, ids, context_length(model), max_new_tokens, "--max-new-tokens")
    rewards = build_rewards(cfg.reward_specs(), on_error=cfg.on_reward_error)
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, n=n, top_p=cfg.sampling.top_p,
                            top_k=cfg.sampling.top_k, stop=tuple(cfg.sampling.stop))
    try:
        say(f"sampling {len(held)} prompts × {n} from {model_spec}", len(held))
        groups = generate_groups(engine, held, ids, list(range(len(held))), rewards, params, progress, media=media)
    finally:
        engine.close()  # vLLM's processes
    say(f"scoring {model_spec}'s samples")
    judge = build_rewards([cot_judge])[0] if cot_judge else None
    per_prompt = _per_prompt(groups, held, rewards, judge, n, ks)
    samples = [x for g in groups for x in g.samples]
    _, negative_entropy = score_certainty(model, samples, engine.pad_token_id,
                                          temperature=temperature if temperature > 0 else 1.0, micro_batch_size=16)
    result: dict[str, Any] = {"model": model_spec, "checkpoint": path, "prompts": len(held), "n": n,
                              "engine": cfg.engine.backend,
                              # "model", "float16" or "int8" (the embedded engine's engine.dtype); vLLM: the model's
                              "engine_weights": getattr(engine, "weights", "model"),
                              "sampling": {"temperature": temperature, "top_p": params.top_p, "top_k": params.top_k,
                                           "max_new_tokens": max_new_tokens, "stop": list(params.stop), "seed": seed}}
    result |= _means(per_prompt, len(held))
    result["response_length"] = statistics.fmean(len(x.completion.token_ids) for x in samples)
    result["token_entropy"] = -float(negative_entropy.mean())
    return result


def _per_prompt(groups: list[Group], held: list[Example], rewards: list[RewardFn], judge: RewardFn | None, n: int,
                ks: list[int]) -> dict[str, dict[int, float]]:
    """Each metric's value on every prompt, by the prompt's index: pass@k and maj@k from the first reward's correctness,
    avg@n, distinct-2, and CoT-pass@k where a judge is given.

    Samples the correctness reward gave no verdict (`has_verdict`: it returned None, or its
    sandbox or service failed) are left out, never counted as wrong: a prompt's metrics use its
    judged samples, and a prompt with fewer than k of them has no pass@k or maj@k (no entry
    under its index). A sample the CoT judge gives no verdict on counts as unsound only where the judge
    did answer: one that failed leaves the prompt out of CoT-pass@k. ``no_verdict`` holds each
    prompt's share of samples without a verdict."""

    fmt = str(rewards[0].kwargs.get("extract", "tag_or_last_number"))
    names = [*(f"pass@{k}" for k in ks), *(f"maj@{k}" for k in ks), "avg", "distinct_2", "no_verdict"]
    names += [f"cot_pass@{k}" for k in ks] if judge else []
    per_prompt: dict[str, dict[int, float]] = {name: {} for name in names}
    for i, g in enumerate(groups):
        kept = judged(g.samples, rewards[0].name)
        per_prompt["no_verdict"][i] = 1 - len(kept) / len(g.samples)
        per_prompt["distinct_2"][i] = distinct_n([x.completion.text for x in g.samples], 2)
        if not kept:
            continue
        correct = [is_correct(x, rewards[0].name) for x in kept]
        answers = [extract_answer(x.completion.text, fmt) for x in kept]
        for k in ks:
            if len(kept) >= k:
                per_prompt[f"pass@{k}"][i] = pass_at_k(len(kept), sum(correct), k)
                per_prompt[f"maj@{k}"][i] = maj_at_k(answers, correct, k)
        per_prompt["avg"][i] = avg_at_k(correct)
        if judge is not None:
            right = [x for x, ok in zip(kept, correct) if ok]
            verdicts = score_group([judge], g.prompt, [x.completion.text for x in right], held[i].fields)
            if not all(judged_by(parts, judge.name) for _, parts in verdicts):
                continue  # the judge gave no verdict on a right answer: this prompt's CoT-pass@k is unknown
            sound = sum(1 for _, parts in verdicts if parts.get(judge.name, 0.0) >= 0.5 and len(parts) == 1)
            for k in ks:
                if len(kept) >= k:
                    per_prompt[f"cot_pass@{k}"][i] = pass_at_k(len(kept), sound, k)
    return per_prompt


def _means(per_prompt: dict[str, dict[int, float]], prompts: int) -> dict[str, Any]:
    """Each metric's mean over the prompts that have it (`_per_prompt`); for a rate (`is_rate`)
    its standard error (null from one prompt) and every prompt's value (null: none), so models
    evaluated on the same prompts can be paired (`compared`); ``<metric>_prompts`` where prompts
    were left out (too few judged samples); the share without a verdict as ``no_verdict_fraction``."""
    out: dict[str, Any] = {}
    for name, values in per_prompt.items():
        if not values:
            continue
        mean, se = mean_and_se(list(values.values()))
        out["no_verdict_fraction" if name == "no_verdict" else name] = mean
        if is_rate(name):
            out[f"{name}_se"] = se if se == se else None
        if len(values) < prompts:
            out[f"{name}_prompts"] = len(values)
    out["per_prompt"] = {name: [values.get(i) for i in range(prompts)] for name, values in per_prompt.items()
                         if is_rate(name)}
    return out


def is_rate(metric: str) -> bool:
    """Whether a metric is a per-prompt rate that gets an error bar and is paired across models:
    pass@k, maj@k, CoT-pass@k and avg."""
    return metric == "avg" or metric.startswith(("pass@", "maj@", "cot_pass@"))


def compared(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The results with each model after the first given ``vs_first``: every rate (`is_rate`) as
    this model's minus the first's, paired by prompt (rlvr.eval.metrics.paired_difference: the
    difference, its standard error, 95% interval and how many prompts both judged). The same
    prompts, rewards and sampling for every model make the pairing valid (`evaluate_model`)."""
    if len(results) < 2:
        return results
    first = results[0].get("per_prompt", {})
    out = [results[0]]
    for r in results[1:]:
        versus = {}
        for name, values in r.get("per_prompt", {}).items():
            mine = {i: v for i, v in enumerate(values) if v is not None}
            theirs = {i: v for i, v in enumerate(first.get(name, [])) if v is not None}
            if set(mine) & set(theirs):
                versus[name] = paired_difference(theirs, mine)
        out.append({**r, "vs_first": versus})
    return out


def markdown_table(results: list[dict[str, Any]], ks: list[int]) -> str:
    columns = [*(f"pass@{k}" for k in ks), *(f"maj@{k}" for k in ks), "avg", "response_length", "token_entropy",
               "distinct_2"]
    columns += [f"cot_pass@{k}" for k in ks if any(f"cot_pass@{k}" in r for r in results)]
    columns += ["no_verdict_fraction"] if any(r.get("no_verdict_fraction") for r in results) else []
    lines = ["| model | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for r in results:  # "–": no prompt had enough samples with a verdict
        cells = ["–" if c not in r else f"{r[c]:.1f}" if c == "response_length" else f"{r[c]:.3f}" + _bar(r, c)
                 for c in columns]
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("± is the 95% interval's half-width, 1.96 standard errors over the prompts.")
    rates = [c for c in columns if is_rate(c)]
    for r in results[1:]:
        versus = r.get("vs_first", {})
        lines += ["", f"{r['model']} minus {results[0]['model']}, paired by prompt (95% interval):", "",
                  "| " + " | ".join(rates) + " |", "|" + "---|" * len(rates),
                  "| " + " | ".join(_difference(versus.get(c)) for c in rates) + " |"]
    return "\n".join(lines) + "\n"


def _bar(result: dict[str, Any], metric: str) -> str:
    se = result.get(f"{metric}_se")
    return f" ±{Z95 * se:.3f}" if isinstance(se, float) else ""


def _difference(d: dict[str, float] | None) -> str:
    if d is None:
        return "–"
    if d["se"] is None:  # one prompt: no interval
        return f"{d['difference']:+.3f}"
    return f"{d['difference']:+.3f} [{d['ci95_low']:+.3f}, {d['ci95_high']:+.3f}]"


def write_results(results: list[dict[str, Any]], ks: list[int], out: Path) -> tuple[Path, Path]:
    """`out` as JSON and `out` with suffix .md as the Markdown table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    md = out.with_suffix(".md")
    md.write_text(markdown_table(results, ks))
    return out, md
