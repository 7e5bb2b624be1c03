"""Pull the final answer out of a model completion.

Reward functions score an answer, not a whole completion: reasoning-gym's scorers, for
instance, give "7" full marks but "<answer>7</answer>" almost none. Each extractor here takes
the completion text and returns the answer string, or None when the completion has none.
When a completion holds several candidates (the model revised itself), the last one wins.
"""

from __future__ import annotations

import re
from collections.abc import Callable

_OPEN_TAG = "<answer>"
_CLOSE_TAG = "</answer>"
_BOXED = "\\boxed{"

# An integer or decimal, with thousands commas only in groups of three ("1,234" but not "1,2"),
# and a minus sign only where it cannot be subtraction (not right after a digit, letter or ")").
_NUMBER = re.compile(r"(?:(?<![\w)])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_tag(text: str) -> str | None:
    """Stripped content of the last ``<answer>…</answer>`` pair, or None if there is none."""
    end = text.rfind(_CLOSE_TAG)
    if end == -1:
        return None
    start = text.rfind(_OPEN_TAG, 0, end)
    if start == -1:
        return None
    return text[start + len(_OPEN_TAG) : end].strip()


def extract_boxed(text: str) -> str | None:
    """Stripped content of the last ``\\boxed{…}``, matching braces so ``\\frac{1}{2}`` survives.

    Escaped braces (``\\{``) do not count. If the last box is never closed (a truncated
    completion) the result is None rather than an earlier box: the model's final answer is lost.
    """
    start = text.rfind(_BOXED)
    if start == -1:
        return None
    depth = 1
    i = start + len(_BOXED)
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2  # skip the escaped character
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start + len(_BOXED) : i].strip()
        i += 1
    return None


def extract_last_number(text: str) -> str | None:
    """The last integer or decimal in the text, without thousands commas ("1,234" → "1234")."""
    matches = _NUMBER.findall(text)
    if not matches:
        return None
    return matches[-1].replace(",", "")


def extract_tag_or_last_number(text: str) -> str | None:
    """The ``<answer>`` tag content if the completion has one, else the last number."""
    tagged = extract_tag(text)
    return tagged if tagged is not None else extract_last_number(text)


def extract_hash(text: str) -> str | None:
    """GSM8K's format: what follows the last ``####`` on its line ("#### 1,234" → "1234")."""
    at = text.rfind("####")
    if at < 0:
        return None
    answer = text[at + 4 :].strip().split("\n", 1)[0].strip()
    return answer.replace(",", "") or None


def extract_boxed_or_last_number(text: str) -> str | None:
    """The last ``\\boxed{}`` content if the completion has one, else the last number."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_last_number(text)


_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """Every fenced code block as (its language tag, lower-cased, "" when untagged; its body), in
    order; an unclosed last fence counts (a completion cut off by its token budget)."""
    return [(lang.lower(), body) for lang, body in _FENCE.findall(text)]


def extract_fenced(text: str, languages: tuple[str, ...]) -> str | None:
    """The last fenced block tagged with one of ``languages`` ("" for untagged), else the last
    <answer> tag's content; None when neither holds anything but space."""
    blocks = [body for lang, body in fenced_blocks(text) if lang in languages]
    found = blocks[-1] if blocks else extract_tag(text)
    return found if found and found.strip() else None


EXTRACTORS: dict[str, Callable[[str], str | None]] = {
    "tag": extract_tag,
    "boxed": extract_boxed,
    "hash": extract_hash,
    "last_number": extract_last_number,
    "tag_or_last_number": extract_tag_or_last_number,
    "boxed_or_last_number": extract_boxed_or_last_number,
}


def extract_answer(text: str, fmt: str = "tag") -> str | None:
    """Extract the answer from ``text`` with the extractor named ``fmt`` (a key of EXTRACTORS)."""
    try:
        extractor = EXTRACTORS[fmt]
    except KeyError:
        raise ValueError(
            f"unknown answer format {fmt!r}; valid formats: {', '.join(EXTRACTORS)}"
        ) from None
    return extractor(text)
