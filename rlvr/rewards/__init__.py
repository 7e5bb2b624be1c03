"""Reward functions: answer extraction, built-in rewards, and their weighted combination."""

from rlvr.rewards.builtin import REWARDS, format_reward, math_verify_reward, reasoning_gym_reward
from rlvr.rewards.combine import RewardFn, build_rewards, load_callable, score
from rlvr.rewards.extract import EXTRACTORS, extract_answer

__all__ = [
    "EXTRACTORS",
    "REWARDS",
    "RewardFn",
    "build_rewards",
    "extract_answer",
    "format_reward",
    "load_callable",
    "math_verify_reward",
    "reasoning_gym_reward",
    "score",
]
