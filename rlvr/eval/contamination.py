"""Contamination checks: was a benchmark's text seen in training? Scores per sample (higher = more
likely seen), and an AUC against known labels.

``min_k_percent``: Shi et al., "Detecting Pretraining Data from Large Language Models" (Min-K% Prob),
arXiv:2310.16789. The mean log-probability of the k% least likely tokens of a text: text the model
has seen has fewer surprising tokens, so a higher score suggests membership. It needs no
reference model; compare scores of suspect and fresh texts of the same kind (``auc``).

``self_critique``: Tao et al., "Detecting Data Contamination from Reinforcement Learning
Post-training for Large Language Models", arXiv:2510.09259. RL trains on prompts, not on
reference texts, and narrows the model's outputs on the prompts it saw (entropy collapse). So the
model answers each problem greedily, is then asked for a different answer, and the per-token
entropy curves of the two responses are compared: a model that stays on its path when told to
leave it (similar curves) scores high. Departure from the paper: the critique instruction is our
own wording (the ``template`` argument).

``contamination_report`` runs either or both on member and non-member prompts (``rlvr
contamination``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import PreTrainedModel

from rlvr.models import eos_token_ids
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.train.logprobs import token_logprobs
from rlvr.train.update import collate
from rlvr.types import Completion, Sample, SamplingParams
from rlvr.data import render_prompt

CRITIQUE_TEMPLATE = (
    "Here is one possible answer to this problem. It may be right or wrong. Write a response that "
    "follows a different line of reasoning, or solves the problem another way.\n"
    "---\n{response}\n---\n"
    "Your new response, different from the one above:"
)
"""The instruction appended (after a blank line) to the problem for self_critique's second pass;
``{response}`` is replaced by the model's first response."""


@torch.no_grad()
def min_k_percent(model: PreTrainedModel, tokenizer: object, texts: Sequence[str], *, k: float = 0.2,
                  batch_size: int = 8) -> list[float]:
    """Min-K% Prob of each text: the mean of its lowest ceil(k·T) token log-probs (T tokens after the first)."""
    if not 0.0 < k <= 1.0:
        raise ValueError(f"k must be in (0, 1], got {k}")
    scores: list[float] = []
    device = next(model.parameters()).device
    for start in range(0, len(texts), batch_size):
        batch = tokenizer(list(texts[start : start + batch_size]), return_tensors="pt", padding=True)  # type: ignore[operator]
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        target = mask.bool().clone()
        target[:, 0] = False
        if tokenizer.padding_side == "left":  # type: ignore[attr-defined]
            raise ValueError("min_k_percent needs a right-padding tokenizer")
        logprobs, _ = token_logprobs(model, ids, mask, target)
        for row, row_mask in zip(logprobs, target):
            values = row[row_mask]
            if len(values) == 0:
                scores.append(float("nan"))
                continue
            count = max(1, int(torch.ceil(torch.tensor(k * len(values))).item()))
            scores.append(float(values.sort().values[:count].mean()))
    return scores


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """ROC AUC of scores against binary labels (True = contaminated): the probability that a random
    positive scores above a random negative, ties counting half (the Mann-Whitney statistic)."""
    positives = [s for s, y in zip(scores, labels) if y]
    negatives = [s for s, y in zip(scores, labels) if not y]
    if not positives or not negatives:
        raise ValueError("AUC needs at least one positive and one negative label")
    wins = sum((p > q) + 0.5 * (p == q) for p in positives for q in negatives)
    return wins / (len(positives) * len(negatives))


def penalized_cosine(a: Sequence[float] | torch.Tensor, b: Sequence[float] | torch.Tensor) -> float:
    """Length-penalised cosine similarity of two curves of possibly different lengths:

        cos(pad(a), pad(b)) · min(|a|, |b|) / max(|a|, |b|)

    where pad appends zeros to the shorter one. 0.0 when either is empty or all zeros."""
    a_T = torch.as_tensor(a, dtype=torch.float64).flatten()
    b_T = torch.as_tensor(b, dtype=torch.float64).flatten()
    short, long = sorted((len(a_T), len(b_T)))
    if short == 0:
        return 0.0
    a_T = torch.nn.functional.pad(a_T, (0, long - len(a_T)))
    b_T = torch.nn.functional.pad(b_T, (0, long - len(b_T)))
    norms = float(a_T.norm() * b_T.norm())
    if norms == 0.0:
        return 0.0
    return float(a_T @ b_T) / norms * short / long


@torch.no_grad()
def self_critique(
    model: PreTrainedModel, tokenizer: Any, problems: Sequence[str], *, max_new_tokens: int = 256,
    template: str = CRITIQUE_TEMPLATE, system_prompt: str | None = None, batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> list[float]:
    """Self-Critique contamination score of each problem (Tao et al., "Detecting Data Contamination
    from Reinforcement Learning Post-training for Large Language Models", arXiv:2510.09259).

    Greedy decoding throughout, both passes batched (``batch_size`` prompts at a time):
      r1 = response to the chat-formatted problem q;
      r2 = response to q, a blank line, and the template with r1 in place of ``{response}`` (a request
           to answer differently; other braces in the template are kept as written);
      E_i = the entropy of the model's next-token distribution at each token of r_i (from
            teacher-forced scoring, which gives the distributions the tokens were decoded from);
      score = penalized_cosine(E1, E2) = cos(pad(E1), pad(E2)) · min(|E1|, |E2|) / max(|E1|, |E2|).
    Entropies are non-negative, so scores lie in [0, 1]; higher = more likely trained on (the
    model keeps its collapsed path even when asked to leave it). ``progress(k)`` is called as k
    more prompts of either pass finish (2·len(problems) in all).
    """

    if "{response}" not in template:
        raise ValueError("the critique template must contain {response}")
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer),
                            max_batch_size=batch_size)
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    first_ids = [render_prompt(tokenizer, q, system_prompt) for q in problems]
    first = [group[0] for group in engine.generate(first_ids, params, progress)]
    second_ids = [render_prompt(tokenizer, f"{q}\n\n{template.replace('{response}', r1.text)}", system_prompt)
                  for q, r1 in zip(problems, first)]
    second = [group[0] for group in engine.generate(second_ids, params, progress)]
    entropies_1 = _response_entropies(model, first_ids, first, engine.pad_token_id, batch_size)
    entropies_2 = _response_entropies(model, second_ids, second, engine.pad_token_id, batch_size)
    return [penalized_cosine(e1, e2) for e1, e2 in zip(entropies_1, entropies_2)]


def _response_entropies(model: PreTrainedModel, prompts: list[list[int]], responses: list[Completion], pad: int,
                        batch_size: int) -> list[torch.Tensor]:
    """Entropy at each response token (teacher-forced, temperature 1), one tensor per response."""
    samples = [Sample(tuple(ids), r, reward=0.0, reward_parts={}, prompt_index=i)
               for i, (ids, r) in enumerate(zip(prompts, responses))]
    device = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for start in range(0, len(samples), batch_size):
        batch = collate(samples[start : start + batch_size], pad, device)
        _, entropy_BT = token_logprobs(model, batch["input_ids"], batch["attention_mask"], batch["loss_mask"])
        out += [row[mask].cpu() for row, mask in zip(entropy_BT, batch["loss_mask"])]
    return out


METHODS = ("self_critique", "min_k")
"""The per-sample scores `contamination_report` can compute (higher = more likely trained on)."""


def contamination_report(
    model: PreTrainedModel, tokenizer: Any, members: Sequence[str], non_members: Sequence[str], *,
    methods: Sequence[str] = METHODS, k: float = 0.2, max_new_tokens: int = 256, system_prompt: str | None = None,
    batch_size: int = 32, progress: Callable[[str, int], None] | None = None,
) -> dict[str, Any]:
    """Each method's score of every prompt, its AUC at telling members (trained on) from
    non-members, and its mean score on each side.

    min_k scores the prompt text itself; self_critique the model's responses to the
    chat-formatted prompt. ``progress(method, k)`` is called as k more prompts are done (self_critique
    counts each prompt twice, once per pass). Returns {"auc": {method: AUC}, "mean": {method:
    {"members": .., "non_members": ..}}, "samples": [{"prompt", "member", <method>: score}, ...]};
    a score that cannot be computed (Min-K% of a one-token text) is None and left out of the AUC
    and the means.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown contamination method {unknown[0]!r}; use {', '.join(METHODS)}")
    if not members or not non_members:
        raise ValueError(f"need member and non-member prompts (got {len(members)} and {len(non_members)})")
    prompts, labels = [*members, *non_members], [True] * len(members) + [False] * len(non_members)
    rows: list[dict[str, Any]] = [{"prompt": p, "member": y} for p, y in zip(prompts, labels)]
    report: dict[str, Any] = {"auc": {}, "mean": {}, "samples": rows}
    for method in methods:
        def step(n: int, method: str = method) -> None:
            if progress is not None:
                progress(method, n)

        if method == "self_critique":
            scores = self_critique(model, tokenizer, prompts, max_new_tokens=max_new_tokens,
                                   system_prompt=system_prompt, batch_size=batch_size, progress=step)
        else:
            scores = _min_k_right_padded(model, tokenizer, prompts, k=k, batch_size=batch_size, progress=step)
        kept = [(s, y) for s, y in zip(scores, labels) if not math.isnan(s)]
        report["auc"][method] = auc([s for s, _ in kept], [y for _, y in kept])
        report["mean"][method] = {side: statistics.fmean([s for s, y in kept if y == is_member])
                                  for side, is_member in (("members", True), ("non_members", False))}
        for row, score in zip(rows, scores):
            row[method] = None if math.isnan(score) else score
    return report


def _min_k_right_padded(model: PreTrainedModel, tokenizer: Any, texts: list[str], *, k: float, batch_size: int,
                        progress: Callable[[int], None]) -> list[float]:
    """min_k_percent in batches, with progress, whatever side the tokenizer pads on."""
    side, tokenizer.padding_side = tokenizer.padding_side, "right"
    try:
        scores: list[float] = []
        for start in range(0, len(texts), batch_size):
            chunk = texts[start : start + batch_size]
            scores += min_k_percent(model, tokenizer, chunk, k=k, batch_size=batch_size)
            progress(len(chunk))
        return scores
    finally:
        tokenizer.padding_side = side
