"""Free-text rewards: BLEU and chrF of the completion against reference texts, computed by
sacreBLEU (Post, "A Call for Clarity in Reporting BLEU Scores", arXiv:1804.08771), the maintained
implementation that machine-translation papers report; rlvr does not reimplement either metric.

- ``bleu``: sentence-level BLEU (Papineni et al., ACL 2002) with sacreBLEU's defaults for one
  sentence: its 13a tokenizer, exponential smoothing, effective n-gram order; ``tokenize`` picks
  another tokenizer ("zh", "ja-mecab", "intl", "char", ...).
- ``chrf``: chrF (Popović, WMT 2015): the character n-gram F-score, n up to 6, β = 2;
  ``word_order = 2`` makes it chrF++ (Popović, WMT 2017).

Both return the score / 100, in [0, 1]. The references are the row's ``references`` (a list, or
one string), else its gold answers (rlvr.rewards.qa.golden: ``golden_answers`` or ``answer``).
The hypothesis is the completion's last ``<answer>`` tag when it has one, else the whole
completion (``extract = "tag"`` requires the tag: none scores 0). An empty hypothesis scores 0.
Sentence BLEU clips each n-gram's count by the reference's, so repeating a likely word earns no
more than writing it once, and its brevity penalty charges a short answer. chrF is kinder to
degenerate text, by its definition: it ignores spaces ("Tomwalkedtothepark." scores 1 against
"Tom walked to the park."), and its recall weighs twice its precision, so a repeated or hedged
answer ("walks walked") can outscore a plain copy of the input; a review (session 35) measured
both. Where that matters, train on BLEU or chrF++ (``word_order = 2``), or add BLEU beside it.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from rlvr.errors import MissingExtra
from rlvr.rewards.extract import extract_tag
from rlvr.rewards.qa import golden

INSTALL = "pip install sacrebleu (or rlvr[text])"


@functools.lru_cache(maxsize=None)
def _metric(name: str, **options: Any) -> Any:
    try:
        from sacrebleu.metrics import BLEU, CHRF
    except ImportError as e:
        raise MissingExtra(f"the {name} reward computes with sacreBLEU, which is not installed: {INSTALL}") from e
    try:
        return BLEU(effective_order=True, **options) if name == "bleu" else CHRF(**options)
    except (KeyError, TypeError, ValueError) as err:  # an unknown tokenizer is a KeyError
        raise ValueError(f"the {name} reward: sacreBLEU refuses {options}: {err!r}") from None


def references(fields: Mapping[str, Any], name: str) -> list[str]:
    refs: Any = fields.get("references")
    if hasattr(refs, "tolist"):  # a numpy array, as a Parquet list column reads back
        refs = refs.tolist()
    if refs is None:
        refs = golden(fields)
    if isinstance(refs, str):
        refs = [refs]
    if not isinstance(refs, list | tuple) or not all(isinstance(r, str) for r in refs):
        raise ValueError(f"{name} reward: 'references' must be a string or a list of strings, got {refs!r:.100}")
    refs = list(refs)
    if not refs:
        raise ValueError(f"{name} reward: the row needs 'references' (a list of texts) or a gold 'answer'")
    return refs


def hypothesis(completion: str, extract: str) -> str:
    if extract not in ("tag", "tag_or_text"):
        raise ValueError(f"extract must be 'tag' or 'tag_or_text', got {extract!r}")
    tagged = extract_tag(completion)
    return (tagged if tagged is not None else "" if extract == "tag" else completion).strip()


def bleu_reward(prompt: str, completion: str, *, extract: str = "tag_or_text", tokenize: str = "13a",
                **row: Any) -> float:
    """Sentence BLEU / 100 of the completion against the row's references (the module docstring)."""
    refs = references(row, "bleu")
    text = hypothesis(completion, extract)
    # min: sacreBLEU's exp(log ...) gives 100.00000000000004 for a perfect match
    return min(1.0, _metric("bleu", tokenize=tokenize).sentence_score(text, refs).score / 100.0) if text else 0.0


def chrf_reward(prompt: str, completion: str, *, extract: str = "tag_or_text", word_order: int = 0,
                **row: Any) -> float:
    """chrF / 100 (chrF++ with ``word_order = 2``) of the completion against the row's references."""
    if isinstance(word_order, bool) or not isinstance(word_order, int) or word_order < 0:
        raise ValueError(f"chrf reward: word_order must be 0, 1 or 2, got {word_order!r}")
    refs = references(row, "chrf")
    text = hypothesis(completion, extract)
    return min(1.0, _metric("chrf", word_order=word_order).sentence_score(text, refs).score / 100.0) if text else 0.0
