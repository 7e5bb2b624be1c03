"""The domain rewards (docs/rewards.md): SQL execution, Verilog simulation, BLEU/chrF and TruthRL's
abstention reward; hand-checked values, and the hostile outputs each must score without crashing."""

from __future__ import annotations

import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlvr import sandbox
from rlvr.data.domains import domain_examples
from rlvr.errors import InfrastructureError
from rlvr.rewards.builtin import GROUP_REWARDS, REWARDS
from rlvr.rewards.qa import abstention_reward
from rlvr.rewards.sql import extract_sql, ngram_similarity, sql_group_reward
from rlvr.rewards.sql_judge import judge
from rlvr.rewards.text import bleu_reward, chrf_reward
from rlvr.rewards.verilog import check_testbench, extract_verilog, refusal, verilog_group_reward


@pytest.fixture(autouse=True)
def quick_sandbox() -> Iterator[None]:
    sandbox.configure("auto", sandbox.Limits(timeout_s=5, cpu_s=4, memory_mb=512))
    yield
    sandbox._default.clear()


SCRIPT = ("CREATE TABLE emp(id INTEGER, name TEXT, dept TEXT, salary REAL);"
          "INSERT INTO emp VALUES (1, 'ann', 'eng', 10.1), (2, 'bob', 'ops', 7.3), (3, 'cy', 'eng', 9.7);")
ENG = "SELECT name FROM emp WHERE dept = 'eng'"


def run(predicted: str, gold: str = ENG, compare: str = "multiset", timeout_s: float = 2.0) -> dict[str, object]:
    return judge({"script": SCRIPT, "gold": gold, "predicted": predicted, "compare": compare,
                  "timeout_s": timeout_s, "max_rows": 1000})


def sql(completion: str, **kwargs: object) -> list[float]:
    return [float(v) for v in sql_group_reward("", [completion], **{"schema": SCRIPT, "query": ENG, **kwargs})]


# --- SQL ---------------------------------------------------------------------------------------

def test_sql_comparison_rules() -> None:
    assert run("SELECT name FROM emp WHERE dept = 'eng' ORDER BY name DESC")["match"]  # a multiset: order free
    ordered = "SELECT name FROM emp ORDER BY id"
    assert not run("SELECT name FROM emp ORDER BY id DESC", gold=ordered, compare="list")["match"]
    assert run("SELECT name FROM emp ORDER BY id", gold=ordered, compare="list")["match"]
    # duplicates count in a multiset, not in a set (BIRD's rule)
    assert not run("SELECT dept FROM emp", gold="SELECT DISTINCT dept FROM emp")["match"]
    assert run("SELECT dept FROM emp", gold="SELECT DISTINCT dept FROM emp", compare="set")["match"]
    # column order is kept
    assert not run("SELECT dept, name FROM emp", gold="SELECT name, dept FROM emp")["match"]
    # two forms of one average agree to 12 digits (they may differ in a double's last one)
    assert run("SELECT AVG(salary) FROM emp", gold="SELECT SUM(salary) / COUNT(salary) FROM emp")["match"]


def test_sql_refuses_everything_but_reading() -> None:
    for hostile in ["DROP TABLE emp", "DELETE FROM emp", "INSERT INTO emp VALUES (9, 'x', 'y', 1)",
                    "ATTACH DATABASE '/tmp/x.db' AS x", "PRAGMA table_info(emp)", "CREATE TEMP TABLE t(x)",
                    "SELECT load_extension('/tmp/x')", "SELECT 1; DROP TABLE emp", "SELEC name FROM emp"]:
        out = run(hostile)
        assert out["gold"] == "ok" and str(out["predicted"]).startswith("error") and not out["match"], (hostile, out)


def test_a_statement_that_is_no_query_does_not_execute() -> None:
    """A review (session 35): ";" or a lone comment "executed" and matched a gold with no rows."""
    for empty in [";", "-- nothing", "REINDEX"]:
        out = run(empty, gold="SELECT name FROM emp WHERE dept = 'hr'")
        assert str(out["predicted"]).startswith("error") and not out["match"], (empty, out)


def test_sql_limits_time_rows_and_size() -> None:
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    assert run(forever, timeout_s=0.3)["predicted"] == "timeout"
    assert run("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT x FROM c")["predicted"] == \
        "too many rows"
    assert "too big" in str(run("SELECT zeroblob(1000000000)")["predicted"])


def test_sql_schema_linking_is_the_jaccard_of_the_columns_read() -> None:
    # gold reads {emp.name, emp.dept}; this reads {emp.name, emp.dept, emp.id}: 2 / 3
    assert run("SELECT name FROM emp WHERE dept = 'eng' ORDER BY id")["schema"] == pytest.approx(2 / 3)
    # SELECT * reads all four columns: 2 / 4, so reading everything does not earn the schema credit
    assert run("SELECT * FROM emp")["schema"] == pytest.approx(2 / 4)
    assert run(ENG)["schema"] == 1.0  # the same query again: re-prepared, not served from a cache
    assert run("DROP TABLE emp")["schema"] == 0.0


def test_ngram_similarity_by_hand() -> None:
    # bigrams {select name, name from, from emp} against those and {emp where, where x, x =, = 1}: 3 / 7
    assert ngram_similarity("SELECT name FROM emp", "select name from emp where x = 1") == pytest.approx(3 / 7)
    assert ngram_similarity("SELECT a FROM t;", "select a from t") == 1.0
    assert ngram_similarity("SELECT 'Ann'", "SELECT 'ann'") < 1.0  # string literals keep their case


def test_extract_sql() -> None:
    assert extract_sql("Sure:\n```sql\nSELECT 1\n```\nand\n```sql\nSELECT 2\n```") == "SELECT 2"
    assert extract_sql("```\nSELECT 3") == "SELECT 3"  # untagged, cut off by the budget
    assert extract_sql("<answer>SELECT 4</answer>") == "SELECT 4"
    assert extract_sql("```python\nprint(1)\n```") is None and extract_sql("SELECT 5") is None


def test_sql_reward_weights_and_parts() -> None:
    right = f"```sql\n{ENG}\n```"
    assert sql(right) == [1.0]
    assert sql("```sql\nSELECT name FROM emp\n```") == [0.0]
    assert sql("no query") == [0.0]
    # Reasoning-SQL's sum: 3 for the rows, 1 for running, 1 × schema, 1 × n-grams
    (value,) = sql_group_reward("", [right], schema=SCRIPT, query=ENG, correct=3.0, executes=1.0,
                                schema_linking=1.0, ngram=1.0)
    assert float(value) == 6.0 and value.info == {"executed": 1.0, "schema_linking": 1.0, "ngram": 1.0}
    (wrong,) = sql_group_reward("", ["```sql\nSELECT name FROM emp\n```"], schema=SCRIPT, query=ENG, executes=1.0)
    assert float(wrong) == 1.0 and wrong.info["schema_linking"] == pytest.approx(1 / 2)


def test_sql_reads_a_database_file_read_only(tmp_path: Path) -> None:
    folder = tmp_path / "shop"
    folder.mkdir()
    db = folder / "shop.sqlite"
    with sqlite3.connect(db) as conn:
        conn.executescript(SCRIPT)
    before = db.read_bytes()
    scores = sql_group_reward("", [f"```sql\n{ENG}\n```", "```sql\nDELETE FROM emp\n```"], db_id="shop",
                              db_dir=str(tmp_path), query=ENG)
    assert [float(s) for s in scores] == [1.0, 0.0]
    assert db.read_bytes() == before
    assert [float(s) for s in sql_group_reward("", [f"```sql\n{ENG}\n```"], db=str(db), SQL=ENG)] == [1.0]


def test_sql_task_faults_are_errors_and_slow_gold_is_infrastructure() -> None:
    with pytest.raises(ValueError, match="gold query fails"):
        sql_group_reward("", ["```sql\nSELECT 1\n```"], schema=SCRIPT, query="SELECT nope FROM emp")
    with pytest.raises(ValueError, match="no database file"):
        sql_group_reward("", ["```sql\nSELECT 1\n```"], db="/nonexistent.sqlite", query=ENG)
    with pytest.raises(ValueError, match="needs 'db'"):
        sql_group_reward("", ["```sql\nSELECT 1\n```"], query=ENG)
    slow = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    (value,) = sql_group_reward("", ["```sql\nSELECT 1\n```"], schema=SCRIPT, query=slow, timeout_s=0.3)
    assert isinstance(value, InfrastructureError)


def test_the_sandbox_gives_the_sql_judge_time_for_both_queries() -> None:
    """A review (session 35): a correct query whose gold took longer than the sandbox's own 5 s
    here scored 0; the run's limits now follow timeout_s, and a run stopped before the gold query
    finished is infrastructure, never a 0."""
    count = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < {n}) SELECT COUNT(*) FROM c"
    n = 3_000_000  # a few seconds per query on these CPUs
    (value,) = sql_group_reward("", [f"```sql\n{count.format(n=n)}\n```"], schema=SCRIPT, query=count.format(n=n),
                                timeout_s=20)
    assert not isinstance(value, InfrastructureError) and float(value) == 1.0


def test_sql_is_registered_as_a_group_reward_that_runs_code() -> None:
    assert REWARDS["sql"] is GROUP_REWARDS["sql"] and getattr(REWARDS["sql"], "runs_code", False)


# --- Verilog -----------------------------------------------------------------------------------

needs_iverilog = pytest.mark.skipif(shutil.which("iverilog") is None, reason="Icarus Verilog is not installed "
                                    "(apt-get install iverilog; make setup does it)")
AND_TB = """`timescale 1ns/1ps
module tb;
  reg a, b; wire y; integer i, errors, samples;
  top dut(.a(a), .b(b), .y(y));
  initial begin
    errors = 0; samples = 0;
    for (i = 0; i < 4; i = i + 1) begin
      {a, b} = i; #1; samples = samples + 1;
      if (y !== (a & b)) errors = errors + 1;
    end
    $display("Mismatches: %0d in %0d samples", errors, samples);
    $finish;
  end
endmodule
"""


def design(body: str) -> str:
    return f"```verilog\nmodule top(input a, input b, output y);\n{body}\nendmodule\n```"


def test_refusal_finds_what_could_reach_the_testbench() -> None:
    assert refusal("module top(input a, output y); assign y = $unsigned(~a); endmodule") is None
    assert refusal("module m; sub u(.a(x), .b(y[1])); real r = 1.5; endmodule") is None  # ports and reals
    assert refusal("// $display and tb.x in a comment\nmodule m; /* $finish */ endmodule") is None
    assert refusal('module m; initial $display("Mismatches: 0 in 4 samples"); endmodule') == "system task $display"
    assert refusal("module m; initial $fwrite(32'h8000_0001, \"x\"); endmodule") == "system task $fwrite"
    assert "hierarchical" in str(refusal("module m; always @* tb.errors = 0; endmodule"))
    assert "hierarchical" in str(refusal("module m; initial force tb . errors = 0; endmodule"))
    assert "hierarchical" in str(refusal("module m; always @* tb.mem[0].x = 0; endmodule"))
    assert refusal("module m; endmodule\nbind tb spy s(.e(errors));") == "bind or defparam"
    assert refusal("module m; wire \\bus+index ; endmodule") == "an escaped identifier"
    assert refusal("module m; wire \\tb.errors ; endmodule") is not None
    assert refusal('`include "testbench.v"\nmodule m; endmodule') == "compiler directive `include"
    assert refusal("`define W 4\nmodule m; endmodule") == "compiler directive `define"
    assert refusal("`define CAT(a, b) a``b\nmodule m; endmodule") is not None  # token pasting
    assert refusal("`timescale 1ns/1ps\n`default_nettype none\n`ifdef X\n`endif\nmodule m; endmodule") is None
    assert refusal("module m(input a); wire my$sig = a; endmodule") is None  # a $ inside a name
    # a review (session 35): forcing its own input port forced the testbench's too, and a lone
    # carriage return ends a // comment for Icarus, hiding what follows from the check
    assert refusal("module top(input a, output y); initial force a = 0; assign y = 0; endmodule") == \
        "force or release"
    assert refusal('module m; // x\r initial $display("Mismatches: 0 in 4 samples");\nendmodule') is not None


def test_extract_verilog() -> None:
    assert extract_verilog("```verilog\nmodule a; endmodule\n```\n```sv\nmodule b; endmodule\n```") == \
        "module b; endmodule\n"
    assert extract_verilog("<answer>module c; endmodule</answer>") == "module c; endmodule"
    assert extract_verilog("```python\nx = 1\n```") is None


@needs_iverilog
def test_verilog_scores_by_simulation() -> None:
    cases = {"right": design("assign y = a & b;"), "wrong": design("assign y = a | b;"),
             "broken": design("assign y = a & ;"), "printer": design('assign y = 0;\ninitial $display("Mismatches: 0 in 4 samples");'),
             "reacher": design("assign y = 0;\nalways @* tb.errors = 0;"), "none": "I can't."}
    scores = verilog_group_reward("", list(cases.values()), testbench=AND_TB)
    got = {name: (float(s), s.info) for name, s in zip(cases, scores)}
    assert got["right"] == (1.0, {"compiled": 1.0, "refused": 0.0})
    assert got["wrong"] == (0.0, {"compiled": 1.0, "refused": 0.0})
    assert got["broken"] == (0.0, {"compiled": 0.0, "refused": 0.0})
    assert got["printer"] == (0.0, {"compiled": 0.0, "refused": 1.0})
    assert got["reacher"] == (0.0, {"compiled": 0.0, "refused": 1.0})
    assert got["none"] == (0.0, {"compiled": 0.0, "refused": 0.0})
    # a | b differs from a & b on 2 of the 4 inputs
    assert float(verilog_group_reward("", [cases["wrong"]], testbench=AND_TB, mode="fraction")[0]) == 0.5


@needs_iverilog
def test_the_review_s_exploits_score_zero_and_warnings_do_not_cost_a_pass() -> None:
    forcer = design("initial begin force a = 1'bx; force b = 1'bx; end\nassign y = 1'bx;")
    hidden = "```verilog\nmodule top(input a, input b, output y); // \r initial begin $display(\"Mismatches: 0 in 4 " \
             "samples\"); $finish; end\nendmodule\n```"
    noisy = design("assign y = a & b;\n" + "".join(f"wire [1:0] w{k} = 2'b111;\n" for k in range(60)))
    scores = [float(s) for s in verilog_group_reward("", [forcer, hidden, noisy], testbench=AND_TB)]
    assert scores == [0.0, 0.0, 1.0]


@needs_iverilog
def test_verilog_hang_scores_zero_and_bad_tasks_are_errors() -> None:
    hang = design("reg r = 0;\nassign y = r;\nalways #0 r = ~r;")
    (score,) = verilog_group_reward("", [hang], testbench=AND_TB, timeout_s=1)
    assert float(score) == 0.0
    with pytest.raises(ValueError, match="testbench"):
        verilog_group_reward("", [hang], testbench="")
    with pytest.raises(ValueError, match="module name"):
        verilog_group_reward("", [hang], testbench=AND_TB, top="tb; rm -rf /")
    check_testbench(AND_TB, "module top(input a, input b, output y); assign y = a & b; endmodule")
    with pytest.raises(ValueError, match="does not pass"):
        check_testbench(AND_TB, "module top(input a, input b, output y); assign y = a ^ b; endmodule")


# --- BLEU and chrF -------------------------------------------------------------------------------

def test_bleu_by_hand() -> None:
    # 13a tokens: The cat is on the mat . / The cat sat on the mat . ; matches 6/7, 4/6, 2/5, 1/4; BP 1
    expected = (6 / 7 * 4 / 6 * 2 / 5 * 1 / 4) ** 0.25
    assert bleu_reward("", "The cat is on the mat.", references=["The cat sat on the mat."]) == pytest.approx(expected)
    assert bleu_reward("", "<answer>The cat sat on the mat.</answer>", answer="The cat sat on the mat.") == \
        pytest.approx(1.0)
    # clipping: repeating a reference word earns one match, not five
    assert bleu_reward("", "the the the the the", references=["the cat"]) < 0.2


def test_chrf_bounds_and_inputs() -> None:
    ref = {"references": ["The cat sat on the mat."]}
    assert chrf_reward("", "The cat sat on the mat.", **ref) == pytest.approx(1.0)
    assert chrf_reward("", "", **ref) == 0.0 and bleu_reward("", "   ", **ref) == 0.0
    assert 0.0 < chrf_reward("", "The cat is on the mat.", **ref) < 1.0
    assert chrf_reward("", "The cat is on the mat.", **ref, word_order=2) != chrf_reward("", "The cat is on the mat.", **ref)
    assert chrf_reward("", "The cat sat on the mat.", extract="tag", **ref) == 0.0  # no tag: nothing
    with pytest.raises(ValueError, match="references"):
        chrf_reward("", "x")
    with pytest.raises(ValueError, match="references"):
        chrf_reward("", "x", references=5)
    with pytest.raises(ValueError, match="refuses"):
        bleu_reward("", "x", references=["x"], tokenize="bogus")
    with pytest.raises(ValueError, match="word_order"):
        chrf_reward("", "x", references=["x"], word_order="2")


# --- abstention (TruthRL) ------------------------------------------------------------------------

def test_abstention_is_ternary() -> None:
    def value(completion: str, **row: object) -> tuple[float, dict[str, float]]:
        out = abstention_reward("", completion, **({"answer": "Paris"} | row))
        return float(out), out.info

    assert value("<answer>Paris</answer>") == (1.0, {"abstained": 0.0, "answered_right": 1.0})
    assert value("<answer>I don't know.</answer>") == (0.0, {"abstained": 1.0, "answered_right": 0.0})
    assert value("<answer>London</answer>") == (-1.0, {"abstained": 0.0, "answered_right": 0.0})
    assert value("Paris")[0] == -1.0  # no answer tag is a wrong answer, not an abstention
    assert value("<answer>the paris</answer>")[0] == 1.0  # SQuAD's normalisation
    # an out-of-knowledge row (gold "I don't know") pays for abstaining only
    assert value("<answer>I dont know</answer>", answer="I don't know")[0] == 1.0
    assert value("<answer>Paris</answer>", answer="I don't know")[0] == -1.0
    assert value("<answer>Paris, France</answer>", check="f1", threshold=0.6)[0] == 1.0
    assert value("<answer>unknown</answer>", phrases=["unknown"]) == (0.0, {"abstained": 1.0, "answered_right": 0.0})
    # a title that contains the phrase is an ordinary answer, not an out-of-knowledge row (a review)
    assert value("<answer>I don't know</answer>", answer="I Don't Know How to Love Him")[0] == 0.0
    with pytest.raises(ValueError, match="phrases"):
        value("<answer>idk</answer>", phrases="idk")
    with pytest.raises(ValueError, match="threshold"):
        value("<answer>Paris</answer>", check="f1", threshold=0.0)
    with pytest.raises(ValueError, match="check"):
        value("<answer>Paris</answer>", check="fuzzy")


# --- the generated tasks -----------------------------------------------------------------------

def test_domain_tasks_have_gold_that_scores_full() -> None:
    for e in domain_examples("sql", size=12, seed=3):
        assert [float(v) for v in sql_group_reward(e.prompt, [f"```sql\n{e.answer}\n```"], **e.fields)] == [1.0]
    for e in domain_examples("past_tense", size=4, seed=3):
        assert chrf_reward(e.prompt, f"<answer>{e.answer}</answer>", **e.fields) == pytest.approx(1.0)
    abstain = domain_examples("abstain", size=4, seed=3)
    assert [e.fields["difficulty"] for e in abstain] == ["easy", "hard", "easy", "hard"]
    assert all(float(abstention_reward(e.prompt, f"<answer>{e.answer}</answer>", **e.fields)) == 1.0 for e in abstain)
    with pytest.raises(ValueError, match="one of"):
        domain_examples("chess", size=1)


@needs_iverilog
def test_verilog_task_references_pass_their_testbenches() -> None:
    for e in domain_examples("verilog", size=12, seed=3):
        check_testbench(e.fields["testbench"], e.fields["reference"])
