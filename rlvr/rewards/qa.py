"""Open-domain QA and ranking rewards: exact match and token F1 against a list of gold answers (as in
SQuAD, Rajpurkar et al., arXiv:1606.05250, and Search-R1, arXiv:2503.09516, whose rows carry
``golden_answers``), and NDCG of a ranking (Järvelin and Kekäläinen, "Cumulated gain-based
evaluation of IR techniques", TOIS 2002).

The answer is the last ``<answer>`` tag's content. Answers are compared after SQuAD's
normalisation: lower case, punctuation removed, the articles a/an/the removed, white space
collapsed. An example's gold is its ``golden_answers`` list when it has one, else its ``answer``.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from rlvr.rewards.extract import extract_answer
from rlvr.rewards.styles import with_info

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalise_answer(text: str) -> str:
    """SQuAD's answer normalisation (see the module docstring)."""
    return " ".join(_ARTICLES.sub(" ", text.lower().translate(_PUNCTUATION)).split())


def golden(fields: Mapping[str, Any]) -> list[str]:
    """An example's gold answers: its ``golden_answers`` (Search-R1's rows), else the ``target`` list
    of verl's ``reward_model.ground_truth`` (Search-R1's parquet), else its ``answer``. Answers that
    normalise to nothing are dropped (an empty reply would match them)."""
    gold: Any = fields.get("golden_answers")
    model = fields.get("reward_model")
    if gold is None and isinstance(model, Mapping) and isinstance(model.get("ground_truth"), Mapping):
        gold = model["ground_truth"].get("target")
    if gold is None:
        gold = fields.get("answer")
    if hasattr(gold, "tolist"):  # a numpy array, as a Parquet list column reads back
        gold = gold.tolist()
    if gold is None:
        return []
    answers = [str(g) for g in gold] if isinstance(gold, list | tuple) else [str(gold)]
    return [g for g in answers if normalise_answer(g)]  # "The", "A", "!" normalise to nothing: no gold


def exact_match(prediction: str, gold: Sequence[str]) -> float:
    """1 if the normalised prediction equals any normalised gold answer, else 0."""
    p = normalise_answer(prediction)
    return float(any(p == normalise_answer(g) for g in gold))


def token_f1(prediction: str, gold: Sequence[str]) -> float:
    """The best token-level F1 over the gold answers: with c the number of tokens the normalised
    prediction and gold share (as multisets), precision c/|p|, recall c/|g|, F1 their harmonic mean;
    0 when either is empty (and 1 when both are)."""
    p = normalise_answer(prediction).split()
    best = 0.0
    for g in gold:
        g_tokens = normalise_answer(g).split()
        if not p or not g_tokens:
            best = max(best, float(p == g_tokens))
            continue
        common = sum((Counter(p) & Counter(g_tokens)).values())
        if common:
            precision, recall = common / len(p), common / len(g_tokens)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def _gold_or_raise(name: str, fields: Mapping[str, Any]) -> list[str]:
    gold = golden(fields)
    if not gold:
        raise ValueError(f"{name}: the example has no golden_answers or answer to compare with (answers that "
                         "normalise to nothing, such as \"The\", do not count)")
    return gold


def exact_match_reward(prompt: str, completion: str, **example: Any) -> float:
    """Exact match of the completion's <answer> with any gold answer (`golden`); 0 without an <answer> tag."""
    gold = _gold_or_raise("exact_match", example)
    got = extract_answer(completion, "tag")
    return 0.0 if got is None else exact_match(got, gold)


def f1_reward(prompt: str, completion: str, **example: Any) -> float:
    """Token F1 of the completion's <answer> with its best gold answer (`golden`); 0 without an <answer> tag."""
    gold = _gold_or_raise("f1", example)
    got = extract_answer(completion, "tag")
    return 0.0 if got is None else token_f1(got, gold)


def ndcg(ranking: Sequence[Any], relevance: Mapping[Any, float], k: int | None = None) -> float:
    """NDCG@k of ``ranking`` (items, best first): DCG = Σᵢ rel(itemᵢ) / log₂(i + 1) over positions i =
    1..k (linear gain, as trec_eval and scikit-learn), divided by the DCG of the items sorted by
    relevance, cut at k too. ``k = None``: no cut. An item ranked twice counts at its first place
    only; unknown items have relevance 0. 0 when nothing is relevant; a negative grade is an error."""
    if any(float(r) < 0 for r in relevance.values()):
        raise ValueError(f"ndcg: relevance grades must be 0 or more, got {dict(relevance)}")
    k = max(len(relevance), len(ranking)) if k is None else k
    seen: set[Any] = set()
    dcg = 0.0
    position = 0
    for item in ranking:
        if item in seen:
            continue
        seen.add(item)
        position += 1
        if position > k:
            break
        dcg += float(relevance.get(item, 0.0)) / math.log2(position + 1)
    ideal = sorted((float(r) for r in relevance.values()), reverse=True)[:k]
    idcg = sum(r / math.log2(i + 2) for i, r in enumerate(ideal))
    return dcg / idcg if idcg > 0 else 0.0


_NUMBER = re.compile(r"\d+")


def read_ranking(completion: str) -> list[str]:
    """The ranking a completion gives: the numbers in its last <answer> tag, in order ("3 > 1 > 2",
    "[3, 1, 2]"), as digit strings without leading zeros; empty without a tag."""
    got = extract_answer(completion, "tag")
    return [] if got is None else [n.lstrip("0") or "0" for n in _NUMBER.findall(got)]


def ndcg_reward(prompt: str, completion: str, *, relevance: Mapping[Any, float] | Sequence[float],
                k: int | None = None, **_: Any) -> float:
    """NDCG@k of the ranking in the completion's <answer> tag (passage numbers, best first) against
    ``relevance``: a mapping from passage number to graded relevance, or a list whose i-th entry is
    passage i + 1's. A completion without a ranking scores 0."""
    if hasattr(relevance, "tolist"):  # a numpy array, as a Parquet list column reads back
        relevance = relevance.tolist()
    if isinstance(relevance, Mapping):
        rel = {str(key).lstrip("0") or "0": float(v) for key, v in relevance.items()}
    elif isinstance(relevance, Sequence) and not isinstance(relevance, str):
        rel = {str(i + 1): float(v) for i, v in enumerate(relevance)}
    else:
        raise ValueError(f"ndcg: relevance must be a mapping or a list, not {type(relevance).__name__}")
    return ndcg(read_ranking(completion), rel, k)


ABSTAIN = ("i dont know",)
"""What an abstention says, after `normalise_answer` ("I don't know." → "i dont know")."""


def abstention_reward(prompt: str, completion: str, *, correct: float = 1.0, abstain: float = 0.0,
                      wrong: float = -1.0, check: str = "exact_match", threshold: float = 1.0,
                      phrases: Sequence[str] = ABSTAIN, **example: Any) -> Any:
    """TruthRL's ternary reward (Wei et al., "TruthRL: Incentivizing Truthful LLMs via Reinforcement
    Learning", arXiv:2509.25760): ``correct`` (+1) for a right answer, ``abstain`` (0) for "I don't
    know", ``wrong`` (−1) for anything else, so that abstaining beats guessing where the model
    would be wrong and loses to answering where it would be right.

    The answer is the completion's last <answer> tag. It abstains when its normalised text
    (`normalise_answer`) contains one of ``phrases`` (TruthRL matches "i dont know" so). It is
    right when ``check`` ("exact_match", or "f1" at or above ``threshold``) finds it equal to a
    gold answer (`golden`). A completion without an <answer> tag is wrong, never an abstention
    nor "no verdict": a policy must not escape the −1 by not answering. A row whose gold is
    itself an abstention (TruthRL's relabelled out-of-knowledge questions) pays ``correct`` for
    abstaining and ``wrong`` for any answer (a gold that normalises to one of ``phrases``; a title
    that contains one is an ordinary answer). With ``check = "f1"``, a low ``threshold`` pays a
    list of candidates: keep it high. Reports ``abstention/abstained`` and
    ``abstention/answered_right``, from which accuracy, abstention and hallucination rates follow
    (TruthRL's truthfulness is accuracy − hallucination)."""
    if check not in ("exact_match", "f1"):
        raise ValueError(f"abstention reward: check must be 'exact_match' or 'f1', got {check!r}")
    if not 0.0 < threshold <= 1.0:
        raise ValueError(f"abstention reward: threshold must be in (0, 1], got {threshold!r}")
    if isinstance(phrases, str) or not all(isinstance(p, str) for p in phrases):
        raise ValueError(f"abstention reward: phrases must be a list of strings, got {phrases!r}")
    marks = [normalise_answer(p) for p in phrases]
    if not all(marks):
        raise ValueError(f"abstention reward: a phrase normalises to nothing: {list(phrases)}")
    gold = _gold_or_raise("abstention", example)
    got = extract_answer(completion, "tag")
    abstained = got is not None and any(m in normalise_answer(got) for m in marks)
    unknowable = any(normalise_answer(g) in marks for g in gold)  # not "I Don't Know How to Love Him"
    if got is None:
        right = False
    elif unknowable:
        right = abstained
    elif abstained:
        return with_info(abstain, {"abstained": 1.0, "answered_right": 0.0})
    else:
        right = (exact_match(got, gold) if check == "exact_match" else token_f1(got, gold)) >= threshold
    return with_info(correct if right else wrong, {"abstained": float(abstained), "answered_right": float(right and not abstained)})
