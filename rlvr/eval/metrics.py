"""Metrics of n sampled answers per prompt. Each takes one prompt's samples; average over prompts.
Error bars over prompts: `mean_and_se`, `paired_difference`."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any


def pass_at_k(n: int, correct: int, k: int) -> float:
    """Unbiased pass@k from n samples of which `correct` are right: 1 - C(n - c, k) / C(n, k).

    Chen et al., "Evaluating Large Language Models Trained on Code", arXiv:2107.03374, eq. 1: the
    probability that at least one of k samples drawn without replacement from the n is correct.
    Computed as 1 - prod_{i = n-c+1}^{n} (1 - k/i), which avoids huge binomials. Needs n >= k;
    with fewer than k wrong samples every k-subset holds a correct one, so pass@k = 1.
    """
    if not 0 <= correct <= n:
        raise ValueError(f"need 0 <= correct <= n, got correct={correct}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass@{k} needs at least k samples per prompt (n = {n}); sample more or lower k")
    if n - correct < k:
        return 1.0
    product = 1.0
    for i in range(n - correct + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def avg_at_k(correct: Sequence[bool]) -> float:
    """Mean accuracy over the samples (avg@k with k = the number of samples)."""
    if not correct:
        raise ValueError("avg@k of no samples")
    return sum(correct) / len(correct)


def maj_at_k(answers: Sequence[str | None], correct: Sequence[bool], k: int) -> float:
    """maj@k: the share of disjoint blocks of k samples (the first k, the next k, ...) whose
    majority answer is a correct one.

    Wang et al., "Self-Consistency Improves Chain of Thought Reasoning", arXiv:2203.11171. Within a
    block, samples without an answer do not vote, ties go to the answer seen first, and a block
    where nobody answered counts as wrong. ``correct[i]`` says whether ``answers[i]`` is right
    (answers are compared as strings, so equal strings must have equal correctness). Averaging
    over the n // k blocks uses every sample when n > k; with n = k it is the usual maj@k.
    """
    if len(answers) != len(correct):
        raise ValueError("answers and correct must have the same length")
    if not 1 <= k <= len(answers):
        raise ValueError(f"maj@{k} needs at least k samples per prompt (n = {len(answers)})")
    blocks = len(answers) // k
    hits = 0
    for b in range(blocks):
        block = list(zip(answers[b * k : (b + 1) * k], correct[b * k : (b + 1) * k]))
        counts: dict[str, int] = {}
        for answer, _ in block:
            if answer is not None:
                counts[answer] = counts.get(answer, 0) + 1
        if not counts:
            continue
        order = [a for a, _ in block if a is not None]
        majority = max(counts, key=lambda a: (counts[a], -order.index(a)))
        hits += next(ok for a, ok in block if a == majority)
    return hits / blocks


def distinct_n(texts: Sequence[str], n: int = 2) -> float:
    """distinct-n: unique word n-grams / all word n-grams over the texts (Li et al., "A
    Diversity-Promoting Objective Function for Neural Conversation Models", arXiv:1510.03055).
    1 = no n-gram repeats; texts shorter than n contribute nothing; 0 when there are none."""
    grams = [tuple(words[i : i + n]) for words in (t.split() for t in texts) for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


Z95 = 1.959964
"""The standard normal's 97.5% quantile: a 95% interval is the estimate ± Z95 standard errors."""


def mean_and_se(values: Sequence[float]) -> tuple[float, float]:
    """The mean of per-prompt values and its standard error, √(s²/m) with s² the sample variance
    (m − 1 in the denominator) of the m values: the prompts are a sample from the questions the
    task could ask, and the error bar says how far the mean could move on another such sample
    (Miller, "Adding Error Bars to Evals: A Statistical Approach to Language Model Evaluations",
    arXiv:2411.00640). A prompt's several samples are averaged into its one value first (its
    pass@k, its accuracy over n), which is that paper's clustered standard error for questions
    sampled several times. NaN for fewer than two values."""
    m = len(values)
    if m == 0:
        raise ValueError("the mean of no values")
    mean = sum(values) / m
    if m < 2:
        return mean, math.nan
    variance = sum((v - mean) ** 2 for v in values) / (m - 1)
    return mean, math.sqrt(variance / m)


def paired_difference(before: Mapping[Any, float], after: Mapping[Any, float]) -> dict[str, float | None]:
    """``after`` − ``before`` over the prompts both have a value for (by key: a prompt's index or
    id): the mean difference, its standard error over the per-prompt differences (`mean_and_se`),
    the 95% interval (± `Z95` standard errors, within [−1, 1] for values in [0, 1]), and how many
    prompts were paired. With one prompt there is no error bar: the standard error and interval
    are None (JSON null). Pairing takes each prompt's own difficulty out of the error, so the
    interval is narrower than the two error bars combined whenever the two runs agree on which
    prompts are hard (Miller, arXiv:2411.00640, the paired-differences section)."""
    common = [key for key in before if key in after]
    if not common:
        raise ValueError("no prompt has a value on both sides")
    diff, se = mean_and_se([after[key] - before[key] for key in common])
    out: dict[str, float | None] = {"difference": diff, "se": None, "ci95_low": None, "ci95_high": None,
                                    "prompts": float(len(common))}
    if len(common) > 1:
        low, high = diff - Z95 * se, diff + Z95 * se
        if all(0.0 <= v <= 1.0 for v in (*before.values(), *after.values())):  # a difference of rates
            low, high = max(-1.0, low), min(1.0, high)
        out |= {"se": se, "ci95_low": low, "ci95_high": high}
    return out
