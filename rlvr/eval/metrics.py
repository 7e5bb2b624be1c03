"""Metrics of n sampled answers per prompt. Each takes one prompt's samples; average over prompts."""

from __future__ import annotations

from collections.abc import Sequence


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
