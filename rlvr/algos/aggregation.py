"""Reduce a per-token loss [B, T] to the scalar that is back-propagated.

The mode names are verl's (``loss_agg_mode``), so users of verl recognise them.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    max_tokens: int | None = None,
) -> Tensor:
    """Aggregate a per-token loss over the unmasked tokens; returns a 0-dim tensor.

    With L_b = sum_t mask_bt the length of sequence b:

    "token-mean":               sum_bt loss_bt mask_bt / total_tokens
        (default total_tokens = sum_bt mask_bt). Every token weighs the same, so a sequence
        weighs in proportion to its length and long answers dominate the update. No
        per-token length bias; DAPO's choice (Yu et al., arXiv:2503.14476).
    "seq-mean-token-mean":      sum_b (sum_t loss_bt mask_bt / L_b) / total_seqs
        (default total_seqs = B; L_b = 0 contributes 0). Original GRPO (Shao et al.,
        arXiv:2402.03300). Each sequence weighs the same, so a token weighs 1/L_b: with A > 0
        short answers are pushed up harder per token, with A < 0 long wrong answers are pushed
        down more weakly, so wrong answers drift longer. This is the length bias of Liu et al.,
        "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    "seq-mean-token-sum":       sum_bt loss_bt mask_bt / total_seqs
        (default total_seqs = B). verl's mode of that name: each sequence contributes the sum of
        its token losses, so a sequence weighs in proportion to its length, as in token-mean,
        but the normaliser counts sequences, not tokens: the loss grows with the mean length
        (about mean(L_b) times token-mean), and a batch of longer answers takes a larger step.
    "seq-mean-token-sum-norm":  sum_bt loss_bt mask_bt / (total_seqs * max_tokens)
        (default total_seqs = B; max_tokens required). Dr.GRPO's constant normaliser
        (arXiv:2503.20783): a token's weight depends neither on its sequence's length nor on
        the batch's token count, so no length bias; the loss is smaller than token-mean by
        about mean(L_b) / max_tokens, which the learning rate absorbs.

    Gradient accumulation: pass the totals of the whole mini-batch to every micro-batch; all
    modes are then sums over sequences with fixed weights, so the micro-batch
    aggregates sum to the mini-batch aggregate exactly.

    Args:
        loss_BT: per-token loss, [B, T]; masked positions are ignored even if NaN/inf.
        mask_BT: 1/True on tokens that count, [B, T].
        mode: one of ``AGGREGATIONS``.
        total_tokens, total_seqs: mini-batch totals for micro-batching; must be > 0.
        max_tokens: the constant normaliser (e.g. the generation budget), > 0.
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown mode {mode!r}; valid modes: {', '.join(AGGREGATIONS)}")
    for name, value in (("total_tokens", total_tokens), ("total_seqs", total_seqs)):
        if value is not None and value <= 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    if mode == "seq-mean-token-sum-norm" and (max_tokens is None or max_tokens <= 0):
        raise ValueError(f"mode {mode!r} needs max_tokens > 0, got {max_tokens}")

    mask_BT = mask_BT.bool()
    masked_loss_BT = torch.where(mask_BT, loss_BT, torch.zeros_like(loss_BT))
    num_seqs = total_seqs if total_seqs is not None else loss_BT.shape[0]

    if mode == "token-mean":
        # An all-masked micro-batch gives 0, not 0/0.
        num_tokens = total_tokens if total_tokens is not None else mask_BT.sum().clamp(min=1)
        return masked_loss_BT.sum() / num_tokens
    if mode == "seq-mean-token-mean":
        lengths_B = mask_BT.sum(dim=1).clamp(min=1).to(loss_BT.dtype)
        return (masked_loss_BT.sum(dim=1) / lengths_B).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return masked_loss_BT.sum() / num_seqs
    assert max_tokens is not None  # checked above; narrows the type
    return masked_loss_BT.sum() / (num_seqs * max_tokens)
