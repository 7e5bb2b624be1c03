"""Recall of the built-in retrievers on the reverse-dictionary task (docs/search.md, "Measured"):
for N WordNet questions, how often the synset's own document is the first hit and in the top 3,
with the definition (what a policy that copies the question searches) and with a paraphrase-like
query (the definition's words shuffled, its first word dropped). Also each index's build time.

    OMP_NUM_THREADS=1 python bench/search_recall.py --questions 500 [--dense] [--corpus-size 10000]

The dense index embeds every document once (cached under RLVR_CACHE): all 82,115 take about half
an hour on one CPU core, so ``--corpus-size N`` measures both indexes on a smaller corpus: the
questions' own documents and N − questions others drawn at random."""

from __future__ import annotations

import argparse
import random
import time

from rlvr.agents.retriever import BM25Index, DenseIndex, Index
from rlvr.agents.wordnet import wordnet_corpus, wordnet_examples


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--questions", type=int, default=500)
    p.add_argument("--dense", action="store_true")
    p.add_argument("--corpus-size", type=int, default=None, help="a smaller corpus holding the questions' documents")
    args = p.parse_args()
    docs = wordnet_corpus()
    examples = wordnet_examples(size=args.questions, seed=1234)
    if args.corpus_size is not None:
        wanted = {e.fields["doc_id"] for e in examples}
        others = [d for d in docs if d.id not in wanted]
        keep = wanted | {d.id for d in random.Random(1).sample(others, max(0, args.corpus_size - len(wanted)))}
        docs = tuple(d for d in docs if d.id in keep)
    rng = random.Random(0)

    def shuffled(text: str) -> str:
        words = text.split()[1:] or text.split()
        rng.shuffle(words)
        return " ".join(words)

    queries = {"definition": [e.fields["definition"] for e in examples],
               "shuffled, first word dropped": [shuffled(e.fields["definition"]) for e in examples]}
    indexes: dict[str, Index] = {}
    t = time.perf_counter()
    indexes["bm25"] = BM25Index(docs)
    print(f"bm25: built in {time.perf_counter() - t:.1f} s over {len(docs)} documents")
    if args.dense:
        t = time.perf_counter()
        indexes["dense"] = DenseIndex(docs)
        print(f"dense: built (or read from the cache) in {time.perf_counter() - t:.1f} s")
    for name, index in indexes.items():
        for kind, qs in queries.items():
            t = time.perf_counter()
            hits = index.search(qs, 3)
            per_query = (time.perf_counter() - t) / len(qs) * 1000
            first = sum(bool(row) and docs[row[0][0]].id == e.fields["doc_id"] for e, row in zip(examples, hits))
            top3 = sum(any(docs[i].id == e.fields["doc_id"] for i, _ in row) for e, row in zip(examples, hits))
            print(f"{name:5s} {kind:30s} recall@1 {first / len(qs):.3f}  recall@3 {top3 / len(qs):.3f}  "
                  f"{per_query:.1f} ms/query")


if __name__ == "__main__":
    main()
