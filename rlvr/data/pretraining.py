"""Plain text as RL prompts, for RL on pre-training data (RLP, `rlvr.train.rlp`).

A corpus is a .txt file (documents separated by blank lines) or a JSONL file with a "text"
column. Each example is a cut through one document at a word boundary: ``context``, the text
before the cut (at most ``context_chars`` characters, starting at a word), and ``target``, the
next ``target_words`` words. The policy sees the context followed by ``think_open`` and writes
a thought. The thought is rewarded by how much it raises the likelihood of the target
(`rlvr.rewards.intrinsic.information_gain`). Cuts are drawn from (seed, example number), so a corpus
gives the same examples every run. Each cut has at least ``min_context_words`` words before it.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from rlvr.data.chat import encode_text, read_rows
from rlvr.data.tasks import Example

WORD = re.compile(r"\S+")


def read_documents(path: str | Path, column: str = "text") -> list[str]:
    """The documents of a .txt file (separated by blank lines) or of a JSONL file's `column`."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text corpus not found: {p}")
    if p.suffix == ".jsonl":
        docs = []
        for number, row in read_rows(p):
            if not isinstance(row.get(column), str):
                raise ValueError(f"{p}:{number}: needs a string column {column!r}")
            docs.append(row[column])
    else:
        docs = [d.strip() for d in re.split(r"\n\s*\n", p.read_text(encoding="utf-8"))]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"{p}: no text")
    return docs


def text_examples(path: str | Path, *, size: int, seed: int, context_chars: int = 512, target_words: int = 1,
                  min_context_words: int = 8, column: str = "text") -> list[Example]:
    """`size` cuts through the corpus's documents (see module docstring). The keywords with defaults
    are task.params of task.source = "text": at most `context_chars` characters of context (from a
    word start), the next `target_words` words as the target, at least `min_context_words` before
    the cut, and the JSONL `column` holding the text."""
    if context_chars < 16 or target_words < 1 or min_context_words < 1:
        raise ValueError(f"task.params: context_chars >= 16, target_words >= 1 and min_context_words >= 1 "
                         f"(got {context_chars}, {target_words}, {min_context_words})")
    docs = read_documents(path, column)
    spans = [[m.span() for m in WORD.finditer(d)] for d in docs]
    usable = [i for i, s in enumerate(spans) if len(s) >= min_context_words + target_words]
    if not usable:
        raise ValueError(f"{path}: no document has {min_context_words + target_words} words "
                         "(task.params min_context_words + target_words)")
    rng = random.Random(seed)
    examples = []
    for n in range(size):
        d = usable[rng.randrange(len(usable))]
        words = spans[d]
        cut = rng.randrange(min_context_words, len(words) - target_words + 1)  # index of the first target word
        end_of_context = words[cut - 1][1]
        # the earliest word from which the context fits context_chars; at least the last word
        first = next((k for k in range(cut) if end_of_context - words[k][0] <= context_chars), cut - 1)
        context = docs[d][words[first][0] : end_of_context]
        target = docs[d][end_of_context : words[cut + target_words - 1][1]]  # with its leading whitespace
        examples.append(Example(prompt=context, answer=target,
                                fields={"context": context, "target": target, "document": d, "answer": target},
                                id=f"{Path(path).name}:{d}:{cut}:{n}"))
    return examples


def context_ids(tokenizer: Any, context: str) -> list[int]:
    """A cut's context as the policy and the no-think baseline both see it: the raw text, with the
    tokenizer's BOS if it adds one."""
    return [int(i) for i in tokenizer(context)["input_ids"]]


def prompt_ids(tokenizer: Any, context: str, think_open: str) -> list[int]:
    """The engine's prompt for a cut: the context, then the thought's opening marker. Tokenized in
    two pieces, so the context's own tokens are exactly those the no-think baseline scores."""
    return context_ids(tokenizer, context) + encode_text(tokenizer, think_open)
