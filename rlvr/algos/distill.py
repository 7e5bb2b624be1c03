"""On-policy distillation: the student samples, a teacher scores every sampled token, and the
per-token reverse KL to the teacher is the (negative) advantage.

Tensors of one sample: ``_N`` its completion tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from rlvr.algos.advantages import check_outcome


def reverse_kl_advantages(student_logprobs_N: Tensor, teacher_logprobs_N: Tensor, *, coef: float = 1.0) -> Tensor:
    """A_t = −coef · (log π_S(y_t) − log π_T(y_t)), for each token y_t the student sampled.

    log π_S − log π_T at a token sampled from π_S is a one-sample estimate of the per-token
    reverse KL, KL(π_S ‖ π_T); minimising the reverse KL by policy gradient on the student's own
    samples is MiniLLM (Gu et al., "MiniLLM: Knowledge Distillation of Large Language Models",
    arXiv:2306.08543), and training on the student's own generations is GKD's on-policy
    distillation (Agarwal et al., "On-Policy Distillation of Language Models: Learning from
    Self-Generated Mistakes", arXiv:2306.13649). Using each token's own term as its advantage,
    with no discounting over later tokens, is Thinking Machines' "On-Policy Distillation" (Lu et
    al., 2025; a blog post, no arXiv id) and tinker-cookbook's: every token is told how much more
    or less likely the teacher finds it, a dense signal where an outcome reward gives one bit.
    Checked against the blog's formula. The advantage is not normalised.
    """
    return -coef * (student_logprobs_N - teacher_logprobs_N)


@dataclass(frozen=True)
class OpdOptions:
    """``algo.advantage_kwargs`` of ``advantage = "opd"``."""

    teacher: str
    """The teacher: a model name, a checkpoint folder or an rlvr run directory (its latest
    checkpoint), with the student's tokenizer."""
    coef: float = 1.0
    """Weight of the reverse-KL advantage."""
    outcome_weight: float = 0.0
    """Weight of the outcome advantage added to every token (0 = pure distillation; 1 mixes in
    the reward as the outcome estimator sees it)."""
    outcome: str = "grpo"
    """The outcome estimator (rlvr.algos.ESTIMATORS) of that mix, with its defaults."""

    def __post_init__(self) -> None:
        if self.coef < 0 or self.outcome_weight < 0:
            raise ValueError(f"coef and outcome_weight must be >= 0 (got {self.coef}, {self.outcome_weight})")
        if self.coef == 0 and self.outcome_weight == 0:
            raise ValueError("coef and outcome_weight are both 0: nothing to train on")
        check_outcome(self.outcome)
