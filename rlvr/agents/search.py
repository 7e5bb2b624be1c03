"""Search agents: the ``search`` environment (``SearchQA``), over a real corpus or an invented world.

Over a real corpus (docs/search.md): WordNet's nouns (``corpus = "wordnet"``, questions from
``task.source = "wordnet"``) or a JSONL corpus in Search-R1's layout, served by a retriever that
this module starts on loopback once per process (``loopback``), or any running Search-R1
retriever named by its URL (``retriever``).

Over an invented world, whose facts exist only in its documents, so the model has to search to
answer: retrieval is BM25 (the rank-bm25 library, ``pip install 'rlvr[agents]'``) over the
corpus, built once per world. The world is generated from a seed: countries with a capital, a
currency, a founding year and a river, one document per country, plus distractor documents about
the cities. ``facts_examples`` gives the questions (``task.source = "facts"``).

Either way, calls follow Search-R1's tags, ``<search>query</search>``, answered with
``<information>…</information>``, or a JSON ``<tool_call>`` to ``search``. The answer goes in
``<answer></answer>`` and is scored by exact match after SQuAD's normalisation (or token F1).
"""

from __future__ import annotations

import functools
import logging
import random
import re
import threading
from dataclasses import dataclass
from typing import Any

from rlvr.agents.env import StepResult
from rlvr.agents.retriever import MINILM, Doc, Retriever, make_index, read_corpus, retrieve, serve
from rlvr.agents.tools import call, parse_tool_calls, tool
from rlvr.agents.wordnet import wordnet_corpus
from rlvr.data import Example
from rlvr.rewards import extract_answer
from rlvr.rewards.qa import exact_match, golden, normalise_answer, token_f1

_SYLLABLES = ["ka", "lo", "mi", "ra", "ten", "vu", "zor", "qua", "bel", "dri", "sha", "no", "pel", "tor", "gin",
              "xa", "fen", "dul", "ri", "mo", "sal", "ve", "kor", "thi"]
_THINGS = ["its glass towers", "an old bridge", "spice markets", "a winter festival", "a famous library",
           "salt mines", "a harbour", "clockmakers", "a hilltop fortress", "tea gardens"]


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    currency: str
    founded: int
    river: str


def _word(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


@functools.lru_cache(maxsize=8)
def world(seed: int = 0, countries: int = 60) -> tuple[tuple[Country, ...], tuple[str, ...]]:
    """The countries and the corpus (one document per country, one per capital) of a world."""
    rng = random.Random(seed)
    used: set[str] = set()

    def fresh(parts: int) -> str:
        while (w := _word(rng, parts)) in used:
            pass
        used.add(w)
        return w

    made = tuple(Country(fresh(2), fresh(3), fresh(2).lower(), rng.randint(1000, 1999), fresh(2))
                 for _ in range(countries))
    docs = [f"{c.name} is a country whose capital is {c.capital}. Its currency is the {c.currency}. "
            f"{c.name} was founded in {c.founded}, and the {c.river} river runs through it." for c in made]
    docs += [f"{c.capital} is a city known for {rng.choice(_THINGS)}." for c in made]
    rng.shuffle(docs)
    return made, tuple(docs)


def facts_examples(*, size: int, seed: int = 0, countries: int = 60) -> list[Example]:
    """``size`` questions about the world of ``seed`` (single-hop, and two-hop through the capital)."""
    made, _ = world(seed, countries)
    rng = random.Random(seed + 1)
    templates = [("What is the capital of {name}?", "capital"), ("What is the currency of {name}?", "currency"),
                 ("In which year was {name} founded?", "founded"), ("Which river runs through {name}?", "river"),
                 ("What is the currency of the country whose capital is {capital}?", "currency"),
                 ("Which river runs through the country whose capital is {capital}?", "river")]
    out = []
    for i in range(size):
        c = rng.choice(made)
        question, field = rng.choice(templates)
        text = question.format(name=c.name, capital=c.capital)
        answer = str(getattr(c, field))
        out.append(Example(text, answer, {"answer": answer, "world_seed": seed, "countries": countries},
                           f"facts/{seed}/{i}"))
    return out


class _Index:
    def __init__(self, docs: tuple[str, ...]) -> None:
        try:
            from rank_bm25 import BM25Okapi
        except ImportError as e:
            raise ImportError("the search environment needs rank-bm25: pip install 'rlvr[agents]'") from e

        self.docs = docs
        self.bm25 = BM25Okapi([_tokens(d) for d in docs])

    def search(self, query: str, k: int) -> list[str]:
        scores = self.bm25.get_scores(_tokens(query))
        best = sorted(range(len(self.docs)), key=lambda i: -scores[i])[:k]
        return [self.docs[i] for i in best if scores[i] > 0]


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())


@functools.lru_cache(maxsize=8)
def _index(seed: int, countries: int) -> _Index:
    return _Index(world(seed, countries)[1])


normalise = normalise_answer


_SEARCH = re.compile(r"<search>(.*?)(?:</search>|$)", re.S)

SEARCH_INSTRUCTION = ("Answer using the search engine: write <search>your query</search> and the results appear "
                      "between <information> tags. Search as often as you need, then give the answer inside "
                      "<answer></answer> tags.")


log = logging.getLogger(__name__)


def load_corpus(corpus: str) -> tuple[Doc, ...]:
    """``"wordnet"`` (WordNet 3.0's noun synsets, rlvr.agents.wordnet) or a JSONL corpus's path."""
    return wordnet_corpus() if corpus == "wordnet" else read_corpus(corpus)


_SERVICES: dict[tuple[str, str, str], str] = {}
_SERVICES_LOCK = threading.Lock()


def loopback(corpus: str, index: str = "bm25", encoder: str = MINILM) -> str:
    """The ``/retrieve`` URL of a service over ``corpus`` in this process, started on 127.0.0.1 at
    the first call for these arguments and kept for the process's life (every request names its
    own ``topk``)."""
    key = (corpus, index, encoder)
    with _SERVICES_LOCK:  # environments built on several threads start one service, not several
        if key not in _SERVICES:
            docs = load_corpus(corpus)
            _, url = serve(Retriever(docs, make_index(docs, index, model=encoder)))
            log.info("retriever: %s over %s (%d documents) at %s", index, corpus, len(docs), url)
            _SERVICES[key] = url
        return _SERVICES[key]


class SearchQA:
    """Answer a question with a search tool (the top ``k`` documents per query).

    Where the documents come from:
    - by default, BM25 over the invented world of the example's ``world_seed`` (in this process);
    - ``corpus``: ``"wordnet"`` or a JSONL corpus in Search-R1's layout, served on loopback by a
      retriever rlvr starts once per process (``index``: ``"bm25"`` or ``"dense"``; ``encoder``: the
      dense index's model, rlvr.agents.retriever);
    - ``retriever``: the ``/retrieve`` URL of a running Search-R1 retriever (``rlvr retrieve``, or
      Search-R1's own server over Wikipedia).

    Return: exact match of the ``<answer>`` with any of the example's ``golden_answers`` (else its
    ``answer``), after SQuAD's normalisation (case, punctuation and articles ignored), or its token
    F1 with ``score = "f1"``; an episode that never answers gets 0. Metrics: tool_calls (searches),
    answered, em, f1, void. A retriever that fails ends the episode without a verdict (env/error)."""

    def __init__(self, example: Example, rewards: Any = None, *, k: int = 3,
                 instruction: str = SEARCH_INSTRUCTION, corpus: str | None = None, index: str = "bm25",
                 encoder: str = MINILM, retriever: str | None = None, score: str = "em",
                 timeout: float = 30.0) -> None:
        if score not in ("em", "f1"):
            raise ValueError(f"search: score must be 'em' or 'f1', not {score!r}")
        if corpus is not None and retriever is not None:
            raise ValueError("search: give corpus (a retriever rlvr starts) or retriever (a URL), not both")
        self.example, self.k, self.instruction, self.score, self.timeout = example, k, instruction, score, timeout
        self.gold = golden({**example.fields, "answer": example.answer})
        self.url = retriever if retriever is not None else (
            loopback(corpus, index, encoder) if corpus is not None else None)
        self.index = None if self.url else _index(int(example.fields.get("world_seed", 0)),
                                                  int(example.fields.get("countries", 60)))
        self.tools = {"search": tool(self.search)}

    def search(self, query: str) -> str:
        """Search the documents.

        Args:
            query: words to look for
        """
        if not isinstance(query, str):  # the model's own tool call: a bad argument, told to it
            raise TypeError(f"query must be text, not {type(query).__name__}")
        return self._found([query])[0]

    def _found(self, queries: list[str]) -> list[str]:
        if self.index is not None:
            hits = [self.index.search(q, self.k) for q in queries]
        else:
            assert self.url is not None
            hits = [[f"{d.title}: {d.text}" if d.title else d.text for d in row]
                    for row in retrieve(self.url, queries, self.k, timeout=self.timeout)]
        return ["\n".join(f"({i + 1}) {doc}" for i, doc in enumerate(row)) or "(no results)" for row in hits]

    def initial_observation(self) -> str:
        return f"{self.example.prompt}\n\n{self.instruction}"

    def step(self, action: str) -> StepResult:
        queries = [q.strip() for q in _SEARCH.findall(action) if q.strip()]
        calls = parse_tool_calls(action)
        answer = extract_answer(action, "tag")
        if answer is not None and not queries and not calls:
            if not self.gold or not any(g.strip() for g in self.gold):  # nothing to match: no verdict
                return StepResult(done=True, metrics={"answered": 1.0, "excluded": 1.0})
            em, f1 = exact_match(answer, self.gold), token_f1(answer, self.gold)
            return StepResult(reward=em if self.score == "em" else f1, done=True,
                              metrics={"answered": 1.0, "em": em, "f1": f1})
        if not queries and not calls:
            return StepResult("Search with <search>query</search>, or answer inside <answer></answer> tags.",
                              metrics={"void": 1.0})
        results = (self._found(queries) if queries else []) + [call(self.tools, c)[0] for c in calls]
        return StepResult("<information>\n" + "\n\n".join(results) + "\n</information>",
                          metrics={"tool_calls": float(len(results))})
