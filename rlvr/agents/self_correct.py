"""Self-correction: the policy answers, is asked (neutrally) to look again, and answers again.

``env.name = "self_correct"`` wraps any task with a verifier. Each attempt is scored by the
task's rewards; the episode's turn rewards carry SCoRe's objective (Kumar et al., "Training
Language Models to Self-Correct via Reinforcement Learning", arXiv:2409.12917):

    turn 0 (the first attempt):   first_reward · r(y₁)
    turn k ≥ 1 (each revision):   r(y_k+1) + bonus · (r(y_k+1) − r(y_k))

``bonus`` is SCoRe's α, the stage-II shaping that pays for improving on the attempt before and
charges for making it worse, so that a policy cannot score by answering twice the same way.
SCoRe's stage I trains the second attempt alone (``first_reward = 0``) while a strong KL keeps
the first attempt near the base model: ``first_kl = β₂/β₁`` weights the KL term on the first
attempt's tokens by that factor (``kl_turn_scale``, which the update reads), with
``algo.kl_coef = β₁`` on the revisions. With ``algo.credit = "turn"`` each attempt's tokens get the
group-relative advantage of the return from that attempt on; with the default, every token
gets the episode's. docs/interaction.md has both stages as a recipe.

The prompt to revise says nothing about whether the answer was right: a revision that knew
would leak the verdict (SCoRe's setting is intrinsic self-correction). Metrics, per episode:
``first_correct``, ``correct`` (the last attempt's: the episode's verdict, which accuracy
counts), ``fixed`` (wrong first, right last), ``broken`` (right first, wrong last) and
``changed`` (the last attempt's text differs from the first's). An episode cut short by a limit
has the verdict of the last attempt it made: ``correct`` is reported turn by turn as the change
from the attempt before, so its sum over the turns is the last attempt's.
"""

from __future__ import annotations

from inspect import signature
from typing import Any

from rlvr.agents.env import StepResult, no_verdict
from rlvr.data import Example
from rlvr.rewards import RewardFn
from rlvr.rewards.combine import score_group

REVISE = ("Look at your answer again. If there is a mistake in it, correct it; if not, keep it. "
          "Give your final answer in the same form as before.")
"""The neutral request to revise: it does not say whether the first answer was right."""


class SelfCorrect:
    """``attempts`` answers to one task (2: SCoRe's setting), each after ``revise`` (REVISE by
    default); ``correct_at`` is the reward at or above which an attempt counts as correct. See
    the module docstring for the turn rewards and metrics."""

    def __init__(self, example: Example, rewards: list[RewardFn], *, attempts: int = 2, revise: str = REVISE,
                 bonus: float = 0.0, first_reward: float = 1.0, correct_at: float = 1.0,
                 first_kl: float = 1.0) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 2:
            raise ValueError(f"self_correct: env.kwargs.attempts must be a whole number >= 2, got {attempts!r}")
        for name, value in (("bonus", bonus), ("first_reward", first_reward), ("correct_at", correct_at),
                            ("first_kl", first_kl)):
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"self_correct: env.kwargs.{name} must be a number, got {value!r}")
        if bonus < 0 or first_kl < 0:
            raise ValueError(f"self_correct: env.kwargs.bonus (SCoRe's alpha) and first_kl must be >= 0, got {bonus} "
                             f"and {first_kl}")
        if not isinstance(revise, str) or not revise.strip():
            raise ValueError("self_correct: env.kwargs.revise must be the (non-empty) request to revise")
        self.example, self.rewards = example, rewards
        self.attempts, self.revise = attempts, revise
        self.bonus, self.first_reward, self.correct_at = float(bonus), float(first_reward), float(correct_at)
        self.kl_turn_scale = None if first_kl == 1 else (float(first_kl), 1.0)
        """The KL term's factor on each turn's tokens (the first attempt's, then the revisions'), or None."""
        self.scores: list[float] = []
        self.answers: list[str] = []

    def initial_observation(self) -> str:
        return self.example.prompt

    def step(self, action: str) -> StepResult:
        total, parts = score_group(self.rewards, self.example.prompt, [action], self.example.fields)[0]
        excluded = no_verdict(parts)
        if excluded:  # a reward without a verdict on this attempt: the episode has none either
            return StepResult(done=True, metrics=excluded)
        k = len(self.scores)
        self.scores.append(total)
        self.answers.append(action.strip())
        reward = self.first_reward * total if k == 0 else total + self.bonus * (total - self.scores[k - 1])
        right = [s >= self.correct_at for s in self.scores]
        # summed over the turns, "correct" is the last attempt's verdict (rlvr.agents.runner.as_groups)
        metrics = {"correct": float(right[-1]) - (float(right[-2]) if k else 0.0)}
        if k == 0:
            metrics["first_correct"] = float(right[0])
        if len(self.scores) < self.attempts:
            return StepResult(self.revise, reward=reward, metrics=metrics)
        first, last = right[0], right[-1]
        return StepResult(reward=reward, done=True, metrics={
            **metrics, "fixed": float(last and not first), "broken": float(first and not last),
            "changed": float(self.answers[-1] != self.answers[0])})


def check(env: Any) -> None:
    """env.kwargs checked before the model loads: an unknown or bad option fails now, with its name."""
    known = [name for name in signature(SelfCorrect).parameters if name not in ("example", "rewards")]
    unknown = sorted(set(env.kwargs) - set(known))
    if unknown:
        raise ValueError(f"self_correct: unknown env.kwargs {unknown[0]!r} (it takes {', '.join(known)})")
    made = SelfCorrect(Example("", None, {}, "check"), [], **env.kwargs)
    turns = getattr(env, "max_turns", made.attempts)
    if turns < made.attempts:
        raise ValueError(f"self_correct: env.max_turns = {turns} ends every episode before its {made.attempts} "
                         f"attempts; set env.max_turns = {made.attempts}")


def self_correct(example: Example, rewards: list[RewardFn], **kwargs: Any) -> SelfCorrect:
    """The environment factory (``env.name = "self_correct"``)."""
    return SelfCorrect(example, rewards, **kwargs)
