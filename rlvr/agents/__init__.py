"""Multi-turn episodes: environments, tools and the episode runner (token-in, token-out)."""

from rlvr.agents.env import Env, StepResult
from rlvr.agents.runner import Episode, Limits, run_episodes

__all__ = ["Env", "Episode", "Limits", "StepResult", "run_episodes"]
