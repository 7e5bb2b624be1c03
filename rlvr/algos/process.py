"""Process supervision: a completion split into reasoning steps, a score per step, and per-token
advantages from the group's step scores.

Shapes: ``_S`` the steps of one completion, ``_N`` its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


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
                       lengths: Sequence[int], *, eps: float = 1e-6) -> list[Tensor]:
    """Per-token advantages of one group from its samples' step rewards (DeepSeekMath's process
    supervision).

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
    if not (len(step_rewards) == len(step_ends) == len(lengths)):
        raise ValueError("step_rewards, step_ends and lengths need one entry per sample")
    for rewards, ends in zip(step_rewards, step_ends):
        if len(rewards) != len(ends):
            raise ValueError(f"a sample has {len(rewards)} step rewards for {len(ends)} steps")
    every = torch.tensor([float(r) for rewards in step_rewards for r in rewards], dtype=torch.float64)
    if every.numel() > 1 and float(every.max() - every.min()) > 0:  # (std of equal values rounds to ~1e-17)
        mean, scale = float(every.mean()), float(every.std()) + eps
    else:  # nothing to rank
        mean, scale = (float(every.mean()) if every.numel() else 0.0), float("inf")
    out = []
    for rewards, ends, n in zip(step_rewards, step_ends, lengths):
        advantages_N = torch.zeros(n, dtype=torch.float64)
        for reward, end in zip(rewards, ends):
            if not 0 <= end < n:
                raise ValueError(f"a step ends on token {end} of a completion of {n} tokens")
            advantages_N[: end + 1] += (float(reward) - mean) / scale
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
    from each token on (process_advantages); "gae", as rewards on each step's last token for PPO's
    critic and GAE (with outcome_weight × the outcome reward on the last token)."""
    gae: dict[str, Any] = field(default_factory=dict)
    """With credit = "gae": GAE's and the critic's options (rlvr.train.critic.GaeOptions)."""

    def __post_init__(self) -> None:
        from rlvr.algos.advantages import ESTIMATORS

        if self.credit not in ("group", "gae"):
            raise ValueError(f"credit must be \"group\" or \"gae\", got {self.credit!r}")
        if self.gae and self.credit != "gae":
            raise ValueError("gae holds the options of credit = \"gae\"")
        if not self.delimiter:
            raise ValueError("delimiter must not be empty")
        if self.outcome_weight < 0:
            raise ValueError(f"outcome_weight must be >= 0, got {self.outcome_weight}")
        if self.outcome not in ESTIMATORS:
            raise ValueError(f"outcome {self.outcome!r} is not an outcome estimator ({', '.join(sorted(ESTIMATORS))})")
