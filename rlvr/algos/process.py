"""Process supervision: a completion split into reasoning steps, a score per step, and per-token
advantages from the group's step scores.

Shapes: ``_S`` the steps of one completion, ``_N`` its tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rlvr.algos.advantages import check_outcome


def split_steps(text: str, delimiter: str = "\n\n") -> list[tuple[int, int]]:
    """The character spans [start, end) of the reasoning steps of ``text``: the pieces between
    occurrences of ``delimiter``, each ending with the delimiter that closes it (the last one ends
    with the text). Pieces of whitespace only join the step before them (or, at the start, the
    step after them), so a blank line or a leading or trailing delimiter is not a step of its own.
    Text without the delimiter is one step."""
    if not delimiter:
        raise ValueError("the step delimiter must not be empty")
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(text):
        found = text.find(delimiter, start)
        end = len(text) if found < 0 else found + len(delimiter)
        if not text[start:end].strip():
            if spans:
                spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start if spans else 0, end))
        start = end
    if not spans and text:  # whitespace only: one step
        spans.append((0, len(text)))
    return spans


def step_text(text: str, span: tuple[int, int], delimiter: str = "\n\n") -> str:
    """A step as a PRM reads it: its span's text without the delimiters that close it and without
    surrounding whitespace (TRL's PRM data holds bare steps; the separator is added by the PRM)."""
    piece = text[span[0] : span[1]].strip()
    while delimiter.strip() and piece.endswith(delimiter.strip()):
        piece = piece[: -len(delimiter.strip())].rstrip()
    return piece


def step_end_tokens(tokenizer: Any, token_ids: Sequence[int], spans: list[tuple[int, int]]) -> list[int]:
    """For each step's character span of ``decode(token_ids, skip_special_tokens=True)`` (the
    completion's text), the index of the token on which the step ends: the first k whose decoded
    prefix reaches the span's end (binary search over prefixes, so ~log2(N) decodes a step). The
    last step ends on the last token, so special tokens after the text (EOS) belong to it."""
    n = len(token_ids)
    ends = []
    for _, char_end in spans:
        low, high = 1, n
        while low < high:  # the shortest prefix whose text is at least char_end long
            mid = (low + high) // 2
            if len(tokenizer.decode(list(token_ids[:mid]), skip_special_tokens=True)) >= char_end:
                high = mid
            else:
                low = mid + 1
        ends.append(low - 1)
    if ends:
        ends[-1] = n - 1
    return ends


def process_advantages(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                       lengths: Sequence[int], *, eps: float = 1e-6, form: str = "sum") -> list[Tensor]:
    """Per-token advantages of one group from its samples' step rewards: ``form = "sum"``,
    DeepSeekMath's process supervision; ``"min"``, min-form credit (`min_form_advantages`).

    r̃_i,j = (r_i,j − mean(R)) / (std(R) + eps),   R = every step reward of the group's samples
    A_i,t = Σ_{j : end(i, j) ≥ t} r̃_i,j              (the normalised rewards of the steps from t's on)

    Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language
    Models", arXiv:2402.03300, Section 4.1.3 ("Process Supervision RL with GRPO"); checked against
    the paper's equations. std is the unbiased sample standard deviation (as rlvr's GRPO), and
    a group whose step rewards are all equal, or that has one step reward, gets advantage 0.

    Args:
        step_rewards: per sample, its steps' rewards in order.
        step_ends: per sample, the token index each step ends on (ascending; see step_end_tokens).
        lengths: per sample, its number of completion tokens.
    Returns:
        per sample, its tokens' advantages, [N].
    """
    if form not in ("sum", "min"):
        raise ValueError(f"form must be \"sum\" or \"min\", got {form!r}")
    if form == "min":
        return min_form_advantages(step_rewards, step_ends, lengths, eps=eps)
    _check(step_rewards, step_ends, lengths)
    every = _normalised(torch.tensor([float(r) for rewards in step_rewards for r in rewards], dtype=torch.float64), eps)
    out, at = [], 0
    for ends, n in zip(step_ends, lengths):
        advantages_N = torch.zeros(n, dtype=torch.float64)
        for j, end in enumerate(ends):
            advantages_N[: end + 1] += every[at + j]
        at += len(ends)
        out.append(advantages_N.float())
    return out


def _check(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]], lengths: Sequence[int]) -> None:
    if not (len(step_rewards) == len(step_ends) == len(lengths)):
        raise ValueError("step_rewards, step_ends and lengths need one entry per sample")
    for rewards, ends, n in zip(step_rewards, step_ends, lengths):
        if len(rewards) != len(ends):
            raise ValueError(f"a sample has {len(rewards)} step rewards for {len(ends)} steps")
        for end in ends:
            if not 0 <= end < n:
                raise ValueError(f"a step ends on token {end} of a completion of {n} tokens")


def _normalised(values: Tensor, eps: float) -> Tensor:
    """(values − mean) / (unbiased std + eps); zeros when they are all equal (nothing to rank: the
    std of equal values rounds to ~1e-17, not 0)."""
    if values.numel() > 1 and float(values.max() - values.min()) > 0:
        return (values - values.mean()) / (float(values.std()) + eps)
    return torch.zeros_like(values)


def min_form_advantages(step_rewards: Sequence[Sequence[float]], step_ends: Sequence[Sequence[int]],
                        lengths: Sequence[int], *, eps: float = 1e-6) -> list[Tensor]:
    """Per-token advantages with min-form credit: a step's return is the lowest reward of that step
    and every step after it, not their sum, and a token's advantage is its step's return
    normalised over the returns of the group's steps:

    m_i,j = min_{j' ≥ j} r_i,j'            A_i,t = (m_i,j(t) − mean(M)) / (std(M) + eps)

    with j(t) the step token t belongs to and M every m_i,j of the group (unbiased std; all equal:
    advantage 0). Summed credit pays for steps: 20 trivially true "1 + 1 = 2" steps in front of a
    wrong answer gave its first token an advantage of +6.3 against −0.6 for a right answer (a
    red-team review, session 19). Under the min a true step adds nothing and a wrong one anywhere
    after a token lowers it. Cheng et al., "Stop Summation: Min-Form Credit Assignment Is All
    Process Reward Model Needs for Reasoning", arXiv:2504.15275 (PURE), whose value is the min of
    future process rewards (they train with a soft-min at a low temperature; this is its limit).

    Args and return as `process_advantages`'."""
    _check(step_rewards, step_ends, lengths)
    returns = []
    for rewards in step_rewards:
        floor, mins = math.inf, []
        for reward in reversed(rewards):
            floor = min(floor, float(reward))
            mins.append(floor)
        returns.append(mins[::-1])
    every = _normalised(torch.tensor([m for mins in returns for m in mins], dtype=torch.float64), eps)
    out, at = [], 0
    for mins, ends, n in zip(returns, step_ends, lengths):
        advantages_N = torch.zeros(n, dtype=torch.float64)
        start = 0
        for j, end in enumerate(ends):
            advantages_N[start : end + 1] = every[at + j]
            start = end + 1
        at += len(mins)
        out.append(advantages_N.float())
    return out


@dataclass(frozen=True)
class ProcessOptions:
    """``algo.advantage_kwargs`` of ``advantage = "process"``."""

    prm: str
    """The process reward: "module:function", called as fn(prompt, steps, **example) with the
    prompt's text and the completion's steps, returning one score per step; or a token-
    classification model (a name, checkpoint folder or run directory) in TRL's PRM layout
    (rlvr.rewards.process.ClassifierPRM)."""
    delimiter: str = "\n\n"
    """What separates reasoning steps in a completion."""
    separator: str = "\n"
    """A classifier PRM's step separator: the text after each step, on whose last token its
    label sits (TRL's PRMConfig.step_separator)."""
    outcome_weight: float = 0.0
    """Weight of the outcome advantage added to every token (0 = process rewards only)."""
    outcome: str = "grpo"
    """The outcome estimator (rlvr.algos.ESTIMATORS) of that mix."""
    credit: str = "group"
    """How step scores become advantages: "group", normalised over the group's steps and summed
    from each token on (process_advantages, DeepSeekMath's); "min", each token's the lowest score
    of its step and those after it, normalised over the group (min_form_advantages, PURE's: extra
    true steps earn nothing, where the sum pays for them); "gae", as rewards on each step's last
    token for PPO's critic and GAE (with outcome_weight × the outcome reward on the last token)."""
    gae: dict[str, Any] = field(default_factory=dict)
    """With credit = "gae": GAE's and the critic's options (rlvr.options.GaeOptions)."""

    def __post_init__(self) -> None:
        if self.credit not in ("group", "min", "gae"):
            raise ValueError(f"credit must be \"group\", \"min\" or \"gae\", got {self.credit!r}")
        if self.gae and self.credit != "gae":
            raise ValueError("gae holds the options of credit = \"gae\"")
        if not self.delimiter:
            raise ValueError("delimiter must not be empty")
        if self.outcome_weight < 0:
            raise ValueError(f"outcome_weight must be >= 0, got {self.outcome_weight}")
        check_outcome(self.outcome)
