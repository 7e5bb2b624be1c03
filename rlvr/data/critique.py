"""Critique tasks: the policy judges a proposed answer to a problem, and is rewarded for a correct
verdict ("correct" or "incorrect", scored by the ``verdict`` reward).

The builder ``critique`` (``task.transforms = [{fn = "critique"}]``) turns any task's examples
into critique examples. Either the rows bring their
own candidates (``candidate_column`` and ``label_column``: e.g. a model's answers, graded), or
the builder makes them from each example's reference answer: the reference itself, or (with
probability ``wrong_fraction``) a wrong answer near it: a number moved by a small amount, or
another example's different answer where the answers are not numbers.

The RL form trains the verdict, rewarded only for agreeing with the known label: critique
reinforcement learning (CRL; Ruan et al., "Critique-Coder: Enhancing Coder Models by Critique
Reinforcement Learning", arXiv:2509.22824, which mixes it into ordinary RL data). The SFT
form (``rlvr sft`` with an ``answer_template``) is critique fine-tuning (Wang et al., "Critique
Fine-Tuning: Learning to Critique is More Effective than Learning to Imitate",
arXiv:2501.17703), whose targets are critiques of noisy answers rather than the answers; here
the target is the verdict, optionally with the reference it rests on (docs/interaction.md).
"""

from __future__ import annotations

import random
import re
from typing import Any

from rlvr.data.tasks import Example
from rlvr.rewards.generative import CRITIQUE_INSTRUCTION, VERDICTS, critique_prompt
from rlvr.rewards.styles import PROMPT_MESSAGES

_INT = re.compile(r"[-+]?\d+")


def critique_examples(pool: list[Example], *, seed: int, wrong_fraction: float = 0.5,
                      candidate_column: str | None = None, label_column: str | None = None,
                      instruction: str = CRITIQUE_INSTRUCTION) -> list[Example]:
    """``pool``'s examples (their prompts without an answer instruction) as critique examples:
    prompt "Problem: … Proposed answer: … {instruction}", answer "correct" or "incorrect", fields
    ``problem``, ``candidate``, ``reference`` (the task's answer, when known) and ``critique_of``
    (the example's id), plus the example's own fields."""
    if (candidate_column is None) != (label_column is None):
        raise ValueError("task.transforms critique: give candidate_column and label_column together (a row's candidate answer "
                         "and whether it is correct), or neither (candidates made from the reference answers)")
    if not 0.0 <= wrong_fraction <= 1.0:
        raise ValueError(f"task.transforms critique: wrong_fraction must be between 0 and 1, got {wrong_fraction}")
    rng = random.Random(seed)
    answers = sorted({ex.answer for ex in pool if ex.answer is not None})
    out = []
    for ex in pool:
        if candidate_column is not None and label_column is not None:
            candidate, right = _given(ex, candidate_column, label_column)
        else:
            if ex.answer is None:
                raise ValueError(f"task.transforms critique: example {ex.id} has no reference answer to make candidates from; "
                                 "give candidate_column and label_column instead")
            right = rng.random() >= wrong_fraction
            candidate = ex.answer if right else _wrong(ex.answer, rng, answers, ex.id)
        if ex.fields.get("images"):
            raise ValueError(f"task.transforms critique: example {ex.id} has images; critique tasks are text only")
        verdict = VERDICTS[0] if right else VERDICTS[1]
        prompt = critique_prompt(ex.prompt, candidate, instruction)
        own = {k: v for k, v in ex.fields.items() if k != PROMPT_MESSAGES}  # the critique's prompt is its text
        fields = {**own, "problem": ex.prompt, "candidate": candidate, "reference": ex.answer,
                  "critique_of": ex.id, "answer": verdict}
        out.append(Example(prompt, verdict, fields, f"critique/{ex.id}"))
    return out


critique_examples.shows_problem_only = True  # type: ignore[attr-defined]


def _given(ex: Example, candidate_column: str, label_column: str) -> tuple[str, bool]:
    """A row's own candidate and its label (true/false, 1/0, or "correct"/"incorrect")."""
    missing = [c for c in (candidate_column, label_column) if c not in ex.fields]
    if missing:
        raise ValueError(f"task.transforms critique: example {ex.id} has no column {missing[0]!r}")
    label = ex.fields[label_column]
    if isinstance(label, str) and label.strip().lower() in VERDICTS:
        right = label.strip().lower() == "correct"
    elif isinstance(label, bool) or label in (0, 1):
        right = bool(label)
    else:
        raise ValueError(f"task.transforms critique: example {ex.id}'s {label_column!r} is {label!r}; a label is true/false, "
                         "1/0, or \"correct\"/\"incorrect\"")
    return str(ex.fields[candidate_column]), right


def _wrong(answer: str, rng: random.Random, answers: list[str], where: str) -> str:
    """A wrong answer near ``answer``: an integer moved by ±1, ±2 or ±10; otherwise another
    example's answer that differs from it."""
    text = answer.strip()
    if _INT.fullmatch(text):
        return str(int(text) + rng.choice((-10, -2, -1, 1, 2, 10)))
    others = [a for a in answers if a.strip().lower() != text.lower()]
    if not others:
        raise ValueError(f"task.transforms critique: no wrong answer to propose for {where}: its answer {answer!r} is not an "
                         "integer and no other example has a different one")
    return rng.choice(others)
