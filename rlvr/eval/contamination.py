"""Contamination checks: was a benchmark's text seen in training? Scores per sample, and an AUC
against known labels.

``min_k_percent``: Shi et al., "Detecting Pretraining Data from Large Language Models" (Min-K% Prob),
arXiv:2310.16789. The mean log-probability of the k% least likely tokens of a text: text the model
has seen has fewer surprising tokens, so a higher score suggests membership. It needs no
reference model; compare scores of suspect and fresh texts of the same kind (``auc``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from rlvr.train.logprobs import token_logprobs


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
