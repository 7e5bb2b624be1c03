"""Example environments, each built per episode by a factory ``(example, rewards, **kwargs) -> Env``
registered in ENVS (``env.name`` in the config; a dotted path names your own).

    tool_math     a task with a checkable answer; the model may run Python (and an MCP server's tools)
                  before answering
    guess_number  find a hidden number from "higher"/"lower" feedback (multi-step, with feedback)
    search        questions answered by searching: a real corpus through a Search-R1 retriever (WordNet,
                  a JSONL corpus or a URL; docs/search.md) or an invented world's documents with BM25
                  (rlvr.agents.search; task.source = "wordnet" or "facts")
    openenv       an environment on an OpenEnv server, over its WebSocket (rlvr.agents.openenv_env)
    harbor        a Harbor task directory, run in rlvr's sandbox, its verifier the reward (rlvr.agents.harbor)
    self_correct  answer, be asked to look again, answer again: SCoRe's self-correction (rlvr.agents.self_correct)
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from rlvr.agents.env import Env, StepResult, no_verdict
from rlvr.agents.harbor import HarborEpisode
from rlvr.agents.openenv_env import OpenEnvEpisode
from rlvr.agents.mcp_tools import describe, mcp_tools
from rlvr.agents.tools import PythonInterpreter, Tool, call, parse_tool_calls
from rlvr.data import Example
from rlvr.rewards import RewardFn, extract_answer
from rlvr.rewards.combine import load_callable, score_group
from rlvr.agents.search import SearchQA
from rlvr.agents.self_correct import self_correct

TOOL_INSTRUCTION = ("You can run Python: write a ```python code block and you will see what it prints. "
                    "When you know the answer, give it inside <answer></answer> tags.")
PLAIN_INSTRUCTION = ("You can run Python: write a ```python code block and you will see what it prints. "
                     "When you know the answer, reply with just the number.")
ANSWER = {"tag": "When you know the answer, give it inside <answer></answer> tags.",
          "plain": "When you know the answer, reply with just the number."}


class ToolMath:
    """Tool-integrated reasoning on any task with a verifier: each turn the model either runs code
    (a ```python block, or a JSON <tool_call>) and sees its output, or answers in <answer> tags,
    which ends the episode with the task's rewards as its return. A turn with neither is void:
    the model is reminded of the format. Metrics: tool_calls, tool_errors, tool_ok (calls that
    ran), answered.

    For a weak model, ``tool_bonus`` (once per episode, for the first call that runs without an
    error) and ``answer_bonus`` (for answering at all) give GRPO a signal before answers are
    right; both default to 0. ``answer_hint`` ends every tool output with a reminder of the
    answer format. ``tool_bonus_at_answer`` pays the tool bonus with the answer instead (for an
    episode that ran a call without an error before answering), so calling the tool again and
    again without ever answering earns nothing.

    ``answer = "tag"``: an answer is a turn with ``<answer>`` tags and no tool call. ``answer =
    "plain"``: any turn without a tool call is the final answer, scored by the task's rewards as
    they are configured (e.g. ``extract = "tag_or_last_number"``); the usual protocol of tool-use
    chat models, and the one a small model finds (no void turns). The instruction follows the
    choice unless one is given.

    ``mcp`` adds the tools an MCP server lists (rlvr.agents.mcp_tools: {command, args} of a stdio
    server or {url} of a streamable-HTTP one), called with JSON ``<tool_call>`` tags; the
    instruction then lists them. ``python = False`` leaves the Python tool out (an episode with the
    server's tools only)."""

    runs_code = True
    """It runs the policy's code in rlvr's sandbox: `rlvr train` checks the sandbox before training."""

    def __init__(self, example: Example, rewards: list[RewardFn], *, instruction: str | None = None,
                 extra_tools: dict[str, Tool] | None = None, tool_bonus: float = 0.0,
                 answer_bonus: float = 0.0, answer_hint: bool = False, answer: str = "tag",
                 tool_bonus_at_answer: bool = False, mcp: dict[str, Any] | None = None, python: bool = True) -> None:
        if answer not in ("tag", "plain"):
            raise ValueError(f"tool_math answer must be \"tag\" or \"plain\", got {answer!r}")
        self.answer = answer
        self.example, self.rewards = example, rewards
        self.python = PythonInterpreter()
        self.tools = {"python": self.python.as_tool()} if python else {}
        self.tools |= extra_tools or {}
        served = mcp_tools(mcp) if mcp is not None else {}
        clash = sorted(set(served) & set(self.tools))
        if clash:
            raise ValueError(f"env.kwargs.mcp: the server's tool {clash[0]!r} has the name of one of rlvr's tools")
        self.tools |= served
        if not self.tools:
            raise ValueError("tool_math has no tools: python = false needs env.kwargs.mcp (a server's tools)")
        if instruction is None:
            instruction = (TOOL_INSTRUCTION if answer == "tag" else PLAIN_INSTRUCTION) if python else ANSWER[answer]
            if served:
                instruction = f"{describe(served)}\n{instruction}"
        self.instruction = instruction
        self.code_tool = "python" if python else None
        self.tool_bonus, self.answer_bonus, self.bonus_paid = tool_bonus, answer_bonus, False
        self.tool_bonus_at_answer, self.tool_ran = tool_bonus_at_answer, False
        self.answer_hint = answer_hint

    def initial_observation(self) -> str:
        return f"{self.example.prompt}\n\n{self.instruction}" if self.instruction else self.example.prompt

    def step(self, action: str) -> StepResult:
        calls = parse_tool_calls(action, code_tool=self.code_tool)
        if not calls and (self.answer == "plain" or extract_answer(action, "tag") is not None):
            total, parts = score_group(self.rewards, self.example.prompt, [action], self.example.fields)[0]
            bonus = self.tool_bonus if self.tool_bonus_at_answer and self.tool_ran else 0.0
            return StepResult(reward=total + self.answer_bonus + bonus, done=True,
                              metrics={"answered": 1.0, **no_verdict(parts)})
        if not calls:
            how = "Write a ```python block to compute" if self.code_tool else "Call a tool in <tool_call> tags"
            return StepResult(f"{how}, or give the final answer in <answer></answer> tags.", metrics={"void": 1.0})
        outputs, errors = [], 0
        for c in calls:
            text, ok = call(self.tools, c)
            errors += not ok or text.startswith("error") or "Error" in (text.splitlines() or [""])[-1]
            outputs.append(text)
        bonus = 0.0
        self.tool_ran = self.tool_ran or errors < len(calls)
        if errors < len(calls) and not self.bonus_paid and not self.tool_bonus_at_answer:
            bonus, self.bonus_paid = self.tool_bonus, True
        hint = ("" if not self.answer_hint else "\n\nIf you have the answer now, give it inside <answer></answer> tags."
                if self.answer == "tag" else "\n\nIf you know the answer now, reply with just the number.")
        return StepResult("Output:\n" + "\n\n".join(outputs) + hint, reward=bonus,
                          metrics={"tool_calls": float(len(calls)), "tool_errors": float(errors),
                                   "tool_ok": float(len(calls) - errors)})


class GuessNumber:
    """Find a hidden integer in [low, high] (drawn from the example's id, so the G episodes of a
    prompt share it); after each guess the model is told "higher", "lower" or "correct". Return:
    1 − (guesses − 1) / max_guesses for a correct guess, 0 otherwise. A turn without a number is
    void. Metrics: guesses, solved."""

    def __init__(self, example: Example, rewards: list[RewardFn], *, low: int = 1, high: int = 20,
                 max_guesses: int = 6) -> None:
        self.low, self.high, self.max_guesses = low, high, max_guesses
        self.secret = random.Random(example.id).randint(low, high)
        self.guesses = 0

    def initial_observation(self) -> str:
        return (f"I am thinking of a whole number from {self.low} to {self.high}. Guess it: reply with one number. "
                "I will say if the number is higher or lower.")

    def step(self, action: str) -> StepResult:
        guess = extract_answer(action, "tag_or_last_number")
        try:
            number = float(guess) if guess is not None else math.nan
            value = int(number) if number == int(number) else None
        except (ValueError, OverflowError):  # no number, nan, or inf ("1e999")
            value = None
        if value is None:
            return StepResult("Reply with one whole number.", metrics={"void": 1.0})
        self.guesses += 1
        if value == self.secret:
            return StepResult(reward=1.0 - (self.guesses - 1) / self.max_guesses, done=True,
                              metrics={"guesses": 1.0, "solved": 1.0})
        hint = "higher" if self.secret > value else "lower"
        return StepResult(f"{value} is wrong: the number is {hint}.", done=self.guesses >= self.max_guesses,
                          metrics={"guesses": 1.0})


def _search(example: Example, rewards: list[RewardFn], **kwargs: Any) -> Env:
    return SearchQA(example, rewards, **kwargs)


ENVS: dict[str, Callable[..., Env]] = {"tool_math": ToolMath, "guess_number": GuessNumber, "search": _search,
                                       "openenv": OpenEnvEpisode, "harbor": HarborEpisode,
                                       "self_correct": self_correct}


def env_factory(name: str) -> Callable[..., Any]:
    """A registered environment, or ``package.module:factory``."""
    if name in ENVS:
        return ENVS[name]
    if ":" in name or "." in name:
        return load_callable(name)
    raise ValueError(f"unknown env {name!r}; choose from {', '.join(ENVS)} or give package.module:factory")
