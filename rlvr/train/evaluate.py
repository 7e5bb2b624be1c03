"""Held-out evaluation during training: greedy accuracy and reward, and optionally pass@k."""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any

from rlvr.agents.runner import episode_metrics
from rlvr.eval.metrics import pass_at_k
from rlvr.train.rollouts import generate_groups, group_metrics, has_verdict, is_correct, judged
from rlvr.types import Group, SamplingParams

if TYPE_CHECKING:
    from rlvr.train.run import Run


def evaluate(run: Run, step: int = 0) -> dict[str, float]:
    """`evaluate_held_out`'s metrics."""
    return evaluate_held_out(run, step)[0]


def evaluate_held_out(run: Run, step: int = 0) -> tuple[dict[str, float], dict[str, float | None]]:
    """Greedy decoding on the held-out prompts: accuracy and mean reward, and each prompt's
    outcome by its example id (1.0 right, 0.0 wrong, None without a verdict), from which the run's
    summary pairs the evaluations before and after training, prompt by prompt even where a resume
    changed the held-out set (rlvr.train.records.held_out_gain). With
    train.eval_samples = n, also n samples per prompt at the training temperature: eval/pass@k
    (unbiased estimator) for k = 1, 2, 4, ... and n, from a generator seeded by the step, so the
    training stream of random numbers is untouched and resume stays exact. Samples without a
    verdict from the correctness reward (`has_verdict`: it returned None, or its sandbox or service
    failed) count in no accuracy or pass@k; eval/no_verdict_fraction says how many there were."""
    run.rollouts.drain()  # the engine's random stream is not shared with a collection under way
    task = run.task
    if not task.eval_examples:
        return {}, {}
    params = SamplingParams(temperature=0.0, max_new_tokens=task.params.max_new_tokens, stop=task.params.stop, n=1)
    groups = _held_out(run, params)
    primary = task.rewards[0].name
    outcomes = {key: float(is_correct(g.samples[0], primary)) if has_verdict(g.samples[0], primary) else None
                for key, g in zip(_keys(task.eval_examples), groups)}
    m = group_metrics(groups, primary)
    # accuracy over the answers that got a verdict; the share that did not is said beside it
    out = {f"eval/{k}": m[k] for k in ("accuracy", "reward", "response_length", "no_verdict_fraction") if k in m}
    # a reward's failures and exclusions, as a training step counts them (present only where some happened)
    out |= {f"eval/{k}": v for k, v in m.items() if k.startswith("rewards/") and k.endswith(("/error", "/excluded"))}
    out |= {f"eval/{k}": v for k, v in episode_metrics(groups).items()}
    n = run.cfg.train.eval_samples
    if n:
        generator = run.engine.generator
        saved = generator.get_state()
        generator.manual_seed(run.cfg.seed * 1_000_003 + step)
        try:
            sampled = _held_out(run, dataclasses.replace(task.params, n=n), rescore=False)
        finally:
            generator.set_state(saved)
        counts = [(len(kept), sum(is_correct(x, primary) for x in kept))
                  for kept in (judged(g.samples, primary) for g in sampled)]
        for k in sorted({*(2**i for i in range(n.bit_length()) if 2**i <= n), n}):
            # each prompt's judged samples (`judged`): one with fewer than k has no pass@k
            estimates = [pass_at_k(m, c, k) for m, c in counts if m >= k]
            if estimates:
                out[f"eval/pass@{k}"] = statistics.fmean(estimates)
    return out, outcomes


def _held_out(run: Run, params: SamplingParams, rescore: bool = True) -> list[Group]:
    """Every held-out prompt sampled with `params` (multi-turn: episodes in fresh environments)."""
    task = run.task
    everything = list(range(len(task.eval_examples)))
    if task.episodes is not None:
        return task.episodes(run.engine, task.eval_examples, everything, params.n, sampling=params, held_out=True)
    groups = generate_groups(run.engine, task.eval_examples, task.eval_ids, everything, task.rewards, params,
                             on_error=run.cfg.on_reward_error, media=task.eval_media)
    if rescore:  # rewards from the policy itself (RLP's information gain of the greedy thoughts)
        for method in run.methods.values():
            groups = method.rescore(run, groups, task.eval_examples, held_out=True)
    return groups


def _keys(examples: list[Any]) -> list[str]:
    """Each example's id, made unique where ids repeat (the second "x" is "x#2")."""
    seen: dict[str, int] = {}
    keys = []
    for ex in examples:
        seen[ex.id] = seen.get(ex.id, 0) + 1
        keys.append(ex.id if seen[ex.id] == 1 else f"{ex.id}#{seen[ex.id]}")
    return keys
