"""Built-in reward functions.

Every reward is a plain callable ``(prompt, completion, **example) -> float``. ``example`` holds
the fields of the prompt's data row (see ``rlvr.data.Example.fields``) merged with the reward's
own ``kwargs`` from the config; each function takes the keywords it needs and ignores the rest.
A user reward is any callable with the same signature, named by a dotted path in the config.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from typing import Any

from math_verify import parse, verify

from rlvr.rewards import gym_scoring
from rlvr.rewards.code import unit_tests_group_reward
from rlvr.rewards.extract import extract_answer
from rlvr.rewards.length import budget_reward, think_mode_reward
from rlvr.rewards.qa import abstention_reward, exact_match_reward, f1_reward, ndcg_reward
from rlvr.rewards.text import bleu_reward, chrf_reward
from rlvr.rewards.verilog import verilog_group_reward
from rlvr.rewards.sql import sql_group_reward
from rlvr.rewards.judges import llm_judge_reward, local_judge_reward
from rlvr.rewards.generative import generative_verifier_reward
from rlvr.rewards.reward_model import reward_model_reward
from rlvr.rewards.visual import exact_answer_reward, iou_reward, multiple_choice_reward

def reasoning_gym_reward(
    prompt: str,
    completion: str,
    *,
    task: str,
    entry: dict[str, Any],
    extract: str = "tag",
    params: dict[str, Any] | None = None,
    **_: Any,
) -> float:
    """reasoning-gym's own score for the extracted answer; 0.0 when nothing can be extracted.

    ``entry`` is the reasoning-gym entry dict the prompt came from; ``params`` are the dataset
    parameters it was built with (``rlvr.data.reasoning_gym_examples`` puts both in the fields):
    some tasks score with config values (decimal_arithmetic's precision, puzzle24's number range).
    Scores may be partial (between 0 and 1) for some tasks.

    The task's scorer runs in a process of its own with a time limit, and never sees an answer
    it would run as code or that scores without solving (rlvr.rewards.gym_scoring).
    """
    answer = extract_answer(completion, extract)
    if answer is None:
        return 0.0
    return gym_scoring.score(task, params, answer, entry)


def _parse_math(text: str) -> list[Any]:
    """math-verify's parse of ``text``, read as LaTeX first.

    A bare expression such as "1+x" parsed as plain text comes back as just its first number,
    so anything without ``$``, ``\\boxed`` or ``\\[`` is wrapped in ``$…$``; plain text is the
    fallback when that finds nothing. Markdown around the whole answer (``**42**``, a code span)
    is taken off first: LaTeX would read ``**42**`` as something else.
    """
    stripped = _MARKDOWN.sub(r"\2", text.strip())
    if "$" not in stripped and "\\boxed" not in stripped and "\\[" not in stripped:
        parsed = parse(f"${stripped}$", parsing_timeout=_timeout_s())
        if parsed:
            return list(parsed)
    return list(parse(stripped, parsing_timeout=_timeout_s()))


_MARKDOWN = re.compile(r"^(\*\*|__|`+)(.+)\1$", re.S)
"""Bold or a code span around the whole answer."""


def _timeout_s() -> int | None:
    """math-verify's time limit: 5 s on the main thread, none elsewhere.

    math-verify times out with ``signal.alarm``, which raises ValueError outside the main
    thread, so worker threads must run without a limit. That is a real hazard: sympy can spend
    unbounded time comparing an answer such as ``9^{9^{9^{9}}}``; a caller that scores in
    threads and cannot afford a hang should score in a process it can kill.
    """
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_verify_reward(
    prompt: str, completion: str, *, answer: str | None, extract: str = "tag", **_: Any
) -> float:
    """1.0 if math-verify finds the extracted answer equal to the gold ``answer``, else 0.0.

    Strict: when extraction fails the completion scores 0.0; the whole completion is never
    searched for a matching expression, so the model is paid only for answering in the format.
    Callable from any thread; see ``_timeout_s`` for the time limit and its hazard.
    """
    if answer is None:
        raise ValueError("math_verify reward needs a gold 'answer' field; the example has None")
    predicted = extract_answer(completion, extract)
    if not predicted:
        return 0.0
    gold = _parse_math(str(answer))
    target = _parse_math(predicted)
    if not gold or not target:
        return 0.0
    return 1.0 if verify(gold, target, timeout_seconds=_timeout_s()) else 0.0


def format_reward(prompt: str, completion: str, *, tag: str = "answer", **_: Any) -> float:
    """1.0 if the completion has exactly one ``<tag>…</tag>`` pair with non-blank content."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if completion.count(open_tag) != 1 or completion.count(close_tag) != 1:
        return 0.0
    start = completion.index(open_tag) + len(open_tag)
    end = completion.index(close_tag)
    return 1.0 if start <= end and _VISIBLE.search(completion[start:end]) else 0.0


_VISIBLE = re.compile(r"[^\s\u200b-\u200f\u2060\ufeff]")
"""A character that shows: not a space, nor a zero-width one (``<answer>\u200b</answer>`` is blank)."""


def majority_vote_reward(
    prompt: str, completions: list[str], *, extract: str = "tag_or_last_number", **_: Any
) -> list[float]:
    """Label-free: 1 for each completion whose answer is the group's most common answer, else 0.

    Test-time RL (Zuo et al., "TTRL: Test-Time Reinforcement Learning", arXiv:2504.16084): the
    majority answer of the sampled group stands in for the missing label. Answers are compared
    as extracted strings with surrounding spaces removed, a number as its value ("12.0", "12" and
    "1,200" vs "1200" agree: `_vote_key`); ties go to the answer seen first (TTRL's); a
    completion without an answer scores 0. Called once per group (a group reward). Without a
    check on diversity it rewards agreeing with oneself: watch ``distinct_answer_fraction``
    (logged every step) for collapse.
    """
    answers = [_vote_key(a) if a else None for a in (extract_answer(c, extract) for c in completions)]
    counts: dict[str, int] = {}
    for a in answers:
        if a:
            counts[a] = counts.get(a, 0) + 1
    if not counts:
        return [0.0] * len(completions)
    majority = max(counts, key=lambda a: (counts[a], -answers.index(a)))
    return [1.0 if a == majority else 0.0 for a in answers]


def _vote_key(answer: str) -> str:
    """What `majority_vote` compares: the answer without surrounding spaces, or, for a number
    (thousands commas allowed), its value written one way."""
    text = answer.strip()
    plain = text.replace(",", "") if re.fullmatch(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?", text) else text
    try:
        value = float(plain)
    except ValueError:
        return text
    if not math.isfinite(value) or not re.fullmatch(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", plain):
        return text
    return str(int(value)) if value == int(value) and abs(value) < 2**53 else repr(value)


_VERDICT_WORDS = re.compile(r"\b(not\s+|isn't\s+|is\s+not\s+)?(correct|incorrect)\b")


def read_verdict(completion: str) -> str | None:
    """A critique's verdict, "correct" or "incorrect": the last <answer> tag's content when the
    completion has one, else the whole text; None when it gives none, or both (an answer that
    hedges has no verdict). "not correct" reads as "incorrect"."""
    tagged = extract_answer(completion, "tag")
    found = {("incorrect" if (negated and word == "correct") or word == "incorrect" else "correct")
             for negated, word in _VERDICT_WORDS.findall((tagged if tagged is not None else completion).lower())}
    return found.pop() if len(found) == 1 else None


def verdict_reward(prompt: str, completion: str, *, answer: str, **_: Any) -> float:
    """1 when the critique's verdict (`read_verdict`) is the example's ``answer`` ("correct" or
    "incorrect": rlvr.data.critique), else 0."""
    gold = str(answer).strip().lower()
    if gold not in ("correct", "incorrect"):
        raise ValueError(f"verdict_reward: the answer must be \"correct\" or \"incorrect\", got {answer!r}")
    return float(read_verdict(completion) == gold)


GROUP_REWARDS: dict[str, Callable[..., list[Any]]] = {"majority_vote": majority_vote_reward,
                                                        "reward_model": reward_model_reward,
                                                        "generative_verifier": generative_verifier_reward,
                                                        "unit_tests": unit_tests_group_reward,
                                                        "local_judge": local_judge_reward,
                                                        "budget": budget_reward,
                                                        "sql": sql_group_reward,
                                                        "verilog": verilog_group_reward}
"""Rewards called once per group with all its completions."""

def one_call_for_many(reward: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """`RewardFn.many` of a group reward that also takes one prompt per completion: the groups'
    completions flattened, each with its prompt, in one call."""
    def many(prompts: list[str], completions: list[list[str]], **kwargs: Any) -> list[Any]:
        return reward([p for p, group in zip(prompts, completions) for _ in group],
                      [c for group in completions for c in group], **kwargs)
    return many


MANY: dict[Callable[..., Any], Callable[..., list[Any]]] = {
    fn: one_call_for_many(fn) for fn in (reward_model_reward, generative_verifier_reward)}
"""Group rewards that also score many groups in one call (`RewardFn.many`, `score_groups`)."""


REWARDS: dict[str, Callable[..., Any]] = {
    "reasoning_gym": reasoning_gym_reward,
    "math_verify": math_verify_reward,
    "format": format_reward,
    "unit_tests": unit_tests_group_reward,
    "majority_vote": majority_vote_reward,
    "reward_model": reward_model_reward,
    "generative_verifier": generative_verifier_reward,
    "llm_judge": llm_judge_reward,
    "local_judge": local_judge_reward,
    "iou": iou_reward,
    "multiple_choice": multiple_choice_reward,
    "exact_answer": exact_answer_reward,
    "verdict": verdict_reward,
    "budget": budget_reward,
    "think_mode": think_mode_reward,
    "exact_match": exact_match_reward,
    "f1": f1_reward,
    "ndcg": ndcg_reward,
    "sql": sql_group_reward,
    "verilog": verilog_group_reward,
    "bleu": bleu_reward,
    "chrf": chrf_reward,
    "abstention": abstention_reward,
}
