"""Process reward models: a score for each reasoning step of a completion.

A PRM is anything with ``score(prompts, steps, examples) -> scores``: for each completion, its
prompt's text, its steps' texts (rlvr.algos.process.split_steps) and its example's fields, one
float per step. Two come built in: a Python function, and a token-classification model trained in
TRL's PRM layout (`ClassifierPRM`).
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from rlvr.models import load_tokenizer, padded_rows, resolve_model_path
from rlvr.rewards.combine import load_callable


class PRM(Protocol):
    def score(self, prompts: Sequence[str], steps: Sequence[Sequence[str]],
              examples: Sequence[dict[str, Any]]) -> list[list[float]]: ...


def checked_scores(scores: Any, steps: Sequence[str], where: str) -> list[float]:
    """``scores`` as one finite float per step, or a ValueError saying what came back and where."""
    try:
        values = [float(v) for v in scores]
    except (TypeError, ValueError):
        raise ValueError(f"{where}: a process reward must return one number per step, got {scores!r}") from None
    if len(values) != len(steps):
        raise ValueError(f"{where}: {len(values)} scores for {len(steps)} steps")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"{where}: a step score is not finite: {values}")
    return values


class FunctionPRM:
    """A Python function as the PRM: ``fn(prompt, steps, **example) -> list[float]``, one score per
    step (a rule-based checker of each step, or a call to a hosted PRM)."""

    def __init__(self, fn: Callable[..., Any], name: str) -> None:
        self.fn, self.name = fn, name

    def score(self, prompts: Sequence[str], steps: Sequence[Sequence[str]],
              examples: Sequence[dict[str, Any]]) -> list[list[float]]:
        return [checked_scores(self.fn(prompt, list(s), **example), s, f"process reward {self.name!r}")
                for prompt, s, example in zip(prompts, steps, examples)]


class ClassifierPRM:
    """A token-classification model as the PRM, in TRL's PRM layout: the input is the prompt's
    tokens (after the tokenizer's BOS, if it has one), then each step's tokens followed by the
    separator's; a step's label sits on the last token of its separator. Its score is the
    probability of the "correct" class there: softmax(logits)[-1] with two or more labels,
    sigmoid(logit) with one. (Lightman et al., "Let's Verify Step by Step", arXiv:2305.20050,
    define the PRM score of a step as this probability.)"""

    def __init__(self, model: Any, tokenizer: Any, separator: str = "\n", batch_size: int = 8) -> None:
        self.model, self.tokenizer, self.batch_size = model.eval(), tokenizer, batch_size
        self.separator_ids = tokenizer.encode(separator, add_special_tokens=False)
        if not self.separator_ids:
            raise ValueError(f"the PRM's step separator {separator!r} encodes to no tokens")

    @classmethod
    def load(cls, spec: str, separator: str, dtype: torch.dtype, device: torch.device) -> ClassifierPRM:
        from transformers import AutoModelForTokenClassification

        path = resolve_model_path(spec)
        model = AutoModelForTokenClassification.from_pretrained(path, dtype=dtype).to(device).requires_grad_(False)
        return cls(model, load_tokenizer(spec), separator)

    def layout(self, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[int]]:
        """(input_ids, the positions of the steps' labels)."""
        tok = self.tokenizer
        ids = ([tok.bos_token_id] if tok.bos_token_id is not None else []) + tok(prompt, add_special_tokens=False)["input_ids"]
        positions = []
        for step in steps:
            ids += tok(step, add_special_tokens=False)["input_ids"] + self.separator_ids
            positions.append(len(ids) - 1)
        return ids, positions

    def padded(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input ids, attention mask) of `rows`, right-padded: a causal model's positions stay put,
        so each label's position in `layout` holds in the batch."""
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        return padded_rows(rows, pad, left=False)

    @torch.no_grad()
    def score(self, prompts: Sequence[str], steps: Sequence[Sequence[str]],
              examples: Sequence[dict[str, Any]]) -> list[list[float]]:
        device = next(self.model.parameters()).device
        out: list[list[float]] = []
        items = [self.layout(p, s) for p, s in zip(prompts, steps)]
        for start in range(0, len(items), self.batch_size):
            chunk = items[start : start + self.batch_size]
            input_ids, attention = self.padded([ids for ids, _ in chunk])
            logits_BTC = self.model(input_ids=input_ids.to(device), attention_mask=attention.to(device)).logits.float()
            for row, (_, positions) in enumerate(chunk):
                at_CS = logits_BTC[row, positions]
                probs = torch.sigmoid(at_CS[:, 0]) if at_CS.shape[-1] == 1 else at_CS.softmax(-1)[:, -1]
                out.append(probs.cpu().tolist())
        return out


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_TIMES = re.compile(r"(?<=[\d)])\s*x\s*(?=[\d(])")


def _value(text: str) -> float | None:
    """The value of an arithmetic expression of numbers, + - * / (× and x for *) and
    parentheses, by the usual precedence; nan for a division by zero; None for anything else."""
    try:
        tree = ast.parse(text.replace("×", "*").strip(), mode="eval")
    except SyntaxError:
        return None

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return float(node.value)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            return -ev(node.operand) if isinstance(node.op, ast.USub) else ev(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult | ast.Div):
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div):
                if b == 0:
                    raise ZeroDivisionError
                return a / b
            return a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        raise ValueError("not arithmetic")

    try:
        value = ev(tree)
    except ZeroDivisionError:
        return math.nan  # arithmetic, but no number: an equation with it is wrong
    except (ValueError, RecursionError, OverflowError):
        return None
    return value if math.isfinite(value) else None


_ARITHMETIC = frozenset("0123456789.+-*/×() \t")
_OPERATOR = frozenset("+-*/×")


def _edge(text: str, from_end: bool) -> str:
    """The longest run of arithmetic characters at the end (or the start) of `text`, scanned in
    one pass (a regular expression for it backtracked for seconds on a long step)."""
    n = 0
    for char in (reversed(text) if from_end else text):
        if char not in _ARITHMETIC:
            break
        n += 1
    return text[len(text) - n :] if from_end else text[:n]


def _equations_right(step: str) -> list[bool]:
    """For each equation chain in `step` ("a op b = c", "a = b = c", any precedence; one line at
    a time), whether all of its sides are equal (to a relative 1e-9). A side that is not
    arithmetic, or a left side cut from prose after an operator ("3 apples + 4 = 7"), is no
    equation."""
    verdicts = []
    for line in _TIMES.sub("*", _THOUSANDS.sub("", step)).splitlines():
        parts = line.split("=")
        chain = [_edge(parts[0], from_end=True)]
        cut = len(chain[0]) < len(parts[0])  # the left side starts inside the line
        for j, part in enumerate(parts[1:], 1):
            if j < len(parts) - 1 and all(char in _ARITHMETIC for char in part):
                chain.append(part)  # a middle side: "a = b = c"
                continue
            chain.append(_edge(part, from_end=False))
            verdict = _chain_right(chain, cut)
            if verdict is not None:
                verdicts.append(verdict)
            chain = [_edge(part, from_end=True)]  # what ends this part may start the next equation
            cut = len(chain[0]) < len(part)
    return verdicts


def _chain_right(sides: list[str], cut: bool) -> bool | None:
    """Whether the sides of one chain are all equal; None when it is no equation."""
    if cut and sides[0].strip()[:1] in _OPERATOR:  # "... apples + 4": not the whole left side
        return None
    values = [v for v in (_value(side) for side in sides) if v is not None]
    if len(values) < 2 or len(values) < len(sides) and _value(sides[0]) is None:
        return None
    return all(abs(v - values[0]) <= 1e-9 * max(1.0, abs(values[0])) for v in values[1:]) \
        and not any(math.isnan(v) for v in values)


def arithmetic_steps(prompt: str, steps: list[str], answer: Any = None, **example: Any) -> list[float]:
    """A rule-based PRM for arithmetic: a step with a wrong equation scores 0, one whose equations
    are all right scores 1, one without an equation 0.5; the last step scores 1 if its last number
    is the answer, else 0. An equation is a chain of arithmetic sides joined by "=", each side
    evaluated with the usual precedence ("2 + 3 * 4 = 14"), every side checked ("2 + 2 = 4 * 10 =
    7" is wrong); thousands separators are read ("1,000 + 2 = 1,002"). (A checker, not a learned
    PRM: for arithmetic tasks such as reasoning-gym's chain_sum, and for trying process
    supervision without a PRM model. It pays a trivially true step like any other: with summed
    credit, padding pays; use ``credit = "min"``, rlvr.algos.process.min_form_advantages.)"""
    scores = []
    for step in steps:
        verdicts = _equations_right(step)
        scores.append(0.5 if not verdicts else float(all(verdicts)))
    if steps:
        numbers = _NUMBER.findall(_THOUSANDS.sub("", steps[-1]))
        try:
            scores[-1] = float(bool(numbers) and answer is not None and float(numbers[-1]) == float(str(answer).replace(",", "")))
        except ValueError:  # an answer that is not a number
            scores[-1] = 0.0
    return scores


PRMS: dict[str, Callable[..., list[float]]] = {"arithmetic_steps": arithmetic_steps}
"""Built-in function PRMs, by name."""


def load_prm(spec: str, separator: str = "\n", dtype: torch.dtype = torch.float32,
             device: torch.device | str = "cpu") -> PRM:
    """``spec`` a key of PRMS or "module:function" → FunctionPRM; else a token-classification
    model (a name, checkpoint folder or run directory) → ClassifierPRM."""
    if spec in PRMS:
        return FunctionPRM(PRMS[spec], spec)
    if ":" in spec and not spec.startswith(("/", ".")) and "/" not in spec.split(":", 1)[0]:
        return FunctionPRM(load_callable(spec), spec)
    return ClassifierPRM.load(spec, separator, dtype, torch.device(device))
