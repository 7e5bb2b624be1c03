"""`rlvr retrieve`: a Search-R1 retriever service over a corpus, or WordNet's corpus and questions as files."""

from __future__ import annotations

import argparse
import threading
from pathlib import Path

from rlvr.agents.retriever import MINILM, Retriever, make_index, serve, write_corpus
from rlvr.agents.search import load_corpus
from rlvr.agents.wordnet import wordnet_corpus, write_questions


def run(args: argparse.Namespace) -> int:
    if args.export:
        out = Path(args.export)
        out.mkdir(parents=True, exist_ok=True)
        write_corpus(wordnet_corpus(), out / "corpus.jsonl")
        write_questions(args.questions, out / "questions.jsonl")
        print(f"{out / 'corpus.jsonl'}\n{out / 'questions.jsonl'}")
        return 0
    docs = load_corpus(args.corpus)
    retriever = Retriever(docs, make_index(docs, args.index, model=args.encoder or MINILM), topk=args.topk)
    server, url = serve(retriever, host=args.host, port=args.port)
    print(f"retriever: {args.index} over {args.corpus} ({len(docs)} documents) at {url} (Ctrl-C stops it)", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.shutdown()
    return 0
