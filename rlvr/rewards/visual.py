"""Rewards for vision-language tasks: a predicted bounding box scored by its IoU with the
reference (Visual-RFT's grounding reward), a multiple-choice letter, and an exact answer.

Each is a plain reward, ``(prompt, completion, **example) -> float``; the example's fields give
the reference (``box``, ``answer``, ``choices``), as rlvr.data.visual's tasks and a dataset's
columns do. Parsing is lenient about layout and strict about ambiguity: an answer that names two
boxes, or two letters where one is asked for, scores 0, so a policy cannot hedge its way to a
reward.
"""

from __future__ import annotations

import math
import re
from typing import Any

from rlvr.rewards.extract import extract_tag, extract_tag_or_last_number

_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
_SEP = r"(?:\s*[,;]\s*|\s+)"  # one way to match any run of spaces: an ambiguous one backtracked for minutes
# four numbers with separators, optionally bracketed, or as two corner points "(x1, y1), (x2, y2)"
_BOX = re.compile(rf"\(\s*({_NUMBER}){_SEP}({_NUMBER})\s*\)\s*(?:[,;]\s*)?(?:to\s*|-\s*)?\(\s*({_NUMBER}){_SEP}({_NUMBER})\s*\)"
                  rf"|({_NUMBER}){_SEP}({_NUMBER}){_SEP}({_NUMBER}){_SEP}({_NUMBER})")


def parse_boxes(text: str) -> list[tuple[float, float, float, float]]:
    """Every box written in ``text``: four numbers separated by commas, semicolons or spaces
    ("[10, 20, 30, 40]", "10 20 30 40", JSON lists, "(10, 20), (30, 40)"), as (x1, y1, x2, y2)
    with each pair of corners put in order; boxes with a non-finite number are dropped."""
    boxes = []
    for m in _BOX.finditer(text):
        x1, y1, x2, y2 = (float(v) for v in (m.groups()[:4] if m.group(1) is not None else m.groups()[4:]))
        if all(math.isfinite(v) for v in (x1, y1, x2, y2)):
            boxes.append((min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)))
    return boxes


def box_iou(a: tuple[float, ...] | list[float], b: tuple[float, ...] | list[float]) -> float:
    """Intersection over union of two (x1, y1, x2, y2) boxes; 0 when either has no area."""
    ax1, ay1, ax2, ay2 = map(float, a)
    bx1, by1, bx2, by2 = map(float, b)
    inter = max(0.0, min(ax2, bx2) - max(ax1, bx1)) * max(0.0, min(ay2, by2) - max(ay1, by1))
    union = (ax2 - ax1) * (ay2 - ay1) + (bx2 - bx1) * (by2 - by1) - inter
    return inter / union if union > 0 and (ax2 - ax1) * (ay2 - ay1) > 0 and (bx2 - bx1) * (by2 - by1) > 0 else 0.0


def iou_reward(prompt: str, completion: str, *, box: Any = None, answer: Any = None, image_size: Any = None,
               threshold: float | None = None, coordinates: str = "auto", **_: Any) -> float:
    """The IoU of the completion's box with the reference ``box`` (or one parsed from ``answer``).

    Visual-RFT (Liu et al., "Visual-RFT: Visual Reinforcement Fine-Tuning", arXiv:2503.01785)
    rewards grounding with the IoU of the predicted box; ``threshold`` in (0, 1] makes it 1 at
    IoU ≥ threshold and 0 below (an accuracy-style reward). The box is read from the <answer> tag
    if the completion has one, else from the whole completion; the answer must hold exactly one
    box (several, or none, score 0: listing candidates is not an answer). ``coordinates`` says
    what the prediction's numbers are: "pixels" (compared as they are), "normalized" (each in
    [0, 1], of the image's ``image_size`` = [width, height]) or "auto" (normalized when all four
    lie in [0, 1] and the reference's do not, with an image size known). A reference in [0, 1]
    itself is compared as it is. (Qwen2.5-VL answers in pixels; models that answer in other
    units, e.g. thousandths, need the reference in those units.)
    """
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise ValueError(f"iou_reward: threshold must be in (0, 1], got {threshold}")
    if box is None and answer is not None:
        gold = parse_boxes(str(answer))
        box = gold[0] if len(gold) == 1 else None
    if box is None or len(box) != 4:
        raise ValueError("iou_reward needs the reference box: a `box` field [x1, y1, x2, y2] or an answer holding one")
    if coordinates not in ("auto", "pixels", "normalized"):
        raise ValueError(f"coordinates must be \"auto\", \"pixels\" or \"normalized\", got {coordinates!r}")
    x1, y1, x2, y2 = map(float, box)
    reference = (min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))
    tagged = extract_tag(completion)
    found = parse_boxes(tagged if tagged is not None else completion)
    if len(found) != 1:
        return 0.0
    predicted = found[0]
    reference_normalized = all(0.0 <= v <= 1.0 for v in reference)
    small = all(0.0 <= v <= 1.0 for v in predicted)
    scale = not reference_normalized and (coordinates == "normalized" or coordinates == "auto" and small
                                          and image_size is not None)
    if scale:
        if image_size is None:
            raise ValueError("coordinates = \"normalized\" needs the image's size (an `image_size` field [width, height])")
        width, height = map(float, image_size)
        predicted = (predicted[0] * width, predicted[1] * height, predicted[2] * width, predicted[3] * height)
    iou = box_iou(predicted, reference)
    return float(iou >= threshold) if threshold is not None else iou


_TAGGED = re.compile(r"^\(?([A-Za-z])\)?[.:)]?(?:\s+(.*))?$", re.DOTALL)
_CHOICE = r"(?:\(([A-Za-z])\)|\b([A-Z])(?![A-Za-z]))"
_FINAL = re.compile(r"(?i:\banswer\b|\boption\b|\bchoice\b)(?:\s*:|[^\n.]{0,40}?(?i:\bis\b))\s*[:\-]?\s*\**\s*" + _CHOICE +
                    r"\**(\s*(?:(?i:or|and)\b|/|,)\s*(?:\([A-Za-z]\)|[A-Z](?![A-Za-z])))?")


def _plain(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().strip(".").lower()


def chosen_letter(completion: str, options: dict[str, str]) -> str | None:
    """The option letter a completion chose, or None.

    With an <answer> tag: its content must be one letter, bracketed or not ("B", "(b)", "B."),
    optionally followed by that option's own text ("(B) the green one"), or be an option's text
    alone; anything else ("A or B", "B, probably") chooses nothing. Without a tag: the letter
    of the last "answer is" or "answer:" (a few words may sit between "answer" and "is", and
    bold marks around the letter; a capital, or any case in brackets), unless a second letter
    follows it ("A or B", "A/B", "A, B"); or the whole completion if it is one such letter."""
    tagged = extract_tag(completion)
    if tagged is None:  # a final \boxed{B} answers like a tag
        boxed = re.findall(r"\\boxed\{\s*\(?([A-Za-z])\)?\s*\}", completion)
        tagged = boxed[-1] if boxed and len(set(boxed)) == 1 else None
    if tagged is not None:
        tagged = re.sub(r"^(?i:option|choice)\s+", "", unwrapped(tagged))
        m = _TAGGED.match(tagged.strip())
        letter = m.group(1).upper() if m else None
        if m and letter in options and (not m.group(2) or _plain(m.group(2)) == _plain(options[letter])):
            return letter
        by_text = [k for k, v in options.items() if v and _plain(v) == _plain(tagged)]
        return by_text[0] if len(by_text) == 1 else None
    finals = [m for m in _FINAL.finditer(completion) if (m.group(1) or m.group(2)).upper() in options]
    if finals:
        return None if finals[-1].group(3) else (finals[-1].group(1) or finals[-1].group(2)).upper()
    m = _TAGGED.match(unwrapped(completion))
    return m.group(1).upper() if m and not m.group(2) and m.group(1).upper() in options else None


def multiple_choice_reward(prompt: str, completion: str, *, answer: str, choices: Any = None, **_: Any) -> float:
    """1 if the completion chose the reference option letter ``answer``, else 0 (chosen_letter
    says what counts as choosing). The options are ``choices`` (a dict letter → text, or a list,
    lettered A, B, ...) when the example has them, else the letters A–E with no text."""
    gold = str(answer).strip().strip("()").upper()
    options = {str(k).upper(): str(v) for k, v in choices.items()} if isinstance(choices, dict) else \
        {chr(ord("A") + i): str(c) for i, c in enumerate(choices)} if choices else dict.fromkeys("ABCDE", "")
    if gold not in options:
        raise ValueError(f"multiple_choice_reward: the answer {answer!r} is not one of the options {', '.join(options)}")
    return float(chosen_letter(completion, options) == gold)


_WRAPPERS = (re.compile(r"^\\boxed\{(.*)\}$", re.S), re.compile(r"^\$+(.*?)\$+$", re.S),
             re.compile(r"^\\[(\[](.*)\\[)\]]$", re.S), re.compile(r"^(\*\*|__|\*|_|`+)(.+)\1$", re.S))


def unwrapped(text: str) -> str:
    r"""`text` without what only dresses a whole answer: markdown bold, italics or code, ``$…$``,
    ``\(…\)``, ``\[…\]`` or ``\boxed{…}`` around all of it (nested too), surrounding spaces."""
    text = text.strip()
    while True:
        for pattern in _WRAPPERS:
            m = pattern.match(text)
            if m:
                text = m.group(m.lastindex or 1).strip()
                break
        else:
            return text


_HEDGES = frozenset({"or", "and", "not", "least", "most", "more", "less", "than", "about", "around", "over", "under",
                     "approximately", "maybe", "between", "to", "plus", "minus"})
"""Words that make "12 <words>" say something other than 12 ("12 or more", "12 or thirteen")."""


def _normal(answer: str) -> str:
    text = unwrapped(answer)
    text = text.replace(",", "") if re.fullmatch(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?\.?", text) else text
    numbers = re.findall(r"-?\d+(?:\.\d+)?", text)
    unit = re.fullmatch(r"[$€£¥]?\s*-?\d+(?:\.\d+)?\.?(?:\s+([A-Za-z]+(?: [A-Za-z]+)?))?", text)
    if len(numbers) == 1 and not re.match(r"-?0\d", numbers[0]) and unit \
            and not (unit.group(1) and _HEDGES & set(unit.group(1).lower().split())):
        value = float(numbers[0])  # one number, perhaps with a unit: "12 apples", "12.", "12.0"
        return str(int(value)) if value == int(value) else repr(value)
    return text


def exact_answer_reward(prompt: str, completion: str, *, answer: str, **_: Any) -> float:
    """1 if the completion's answer equals ``answer`` as text, else 0; e.g. a count or a digit
    string read from an image. The answer is the <answer> tag's content, else the completion's
    last number (so a completion that names several numbers answers with its last). Both are
    compared without dressing (`unwrapped`: ``**12**``, ``$12$``) and, when each is one number
    (thousands commas allowed; perhaps a currency sign before it, a full stop or a unit of one or
    two words after it: "12 apples"), by value ("12.0" is "12"); anything else stays text: two
    numbers ("12 or 13"), words before the number ("at least 12", "Gemini 11"), a hedge after it
    ("12 or more"), a digit string with a leading zero ("007")."""
    got = extract_tag_or_last_number(completion)
    return float(got is not None and _normal(got) == _normal(str(answer)))
