"""Small generated tasks for the domain rewards (docs/rewards.md), each one the bundled model can
start on: ``task.source = "domain"`` with ``task.name`` one of `DOMAINS`.

- "sql": questions about a small table of pets (made afresh for each question), answered with one
  SQLite query; the row carries ``schema`` (the script that builds the table) and ``query`` (the
  gold), for the ``sql`` reward.
- "verilog": one-output combinational circuits of two or three inputs described in words; the row
  carries ``testbench`` (every input combination against the gold expression, VerilogEval's
  verdict line) and ``reference``, for the ``verilog`` reward.
- "past_tense": a sentence to rewrite in the past tense; the row carries ``references``, for the
  ``bleu`` and ``chrf`` rewards.
- "abstain": a number to repeat (easy: the bundled model can, once it knows the answer format)
  or a product of two four-digit numbers (hard: it never knows it), in equal shares; for the
  ``abstention`` reward, where "I don't know" should win on the hard ones only. (One-digit sums
  would be the natural easy half, but the bundled model gets them right in well under half its
  tries, where abstaining is the better bet: TruthRL's reward then teaches it to abstain on
  everything, as docs/LOG.md records.) The row's
  ``difficulty`` says which; its ``demonstration`` (for a warm start's template) is the answer,
  or "I don't know" for a third of the rows drawn at random whatever their difficulty.
"""

from __future__ import annotations

import itertools
import random
import re
from collections.abc import Callable

from rlvr.data.tasks import Example

_NAMES = ["Max", "Luna", "Bella", "Charlie", "Daisy", "Milo", "Coco", "Rocky", "Nala", "Oscar", "Ruby", "Toby",
          "Leo", "Lily", "Jack", "Rosie", "Buddy", "Molly", "Simba", "Chloe", "Teddy", "Zoe", "Bailey", "Lola",
          "Finn", "Pepper", "Ziggy", "Olive", "Bruno", "Hazel", "Otis", "Maple"]
_SPECIES = ["cat", "dog", "bird", "fish", "rabbit", "turtle"]
_OWNERS = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay"]
SQL_TABLE = "CREATE TABLE pets (id INTEGER PRIMARY KEY, name TEXT, species TEXT, age INTEGER, owner TEXT);"


def _pets(rng: random.Random) -> list[tuple[int, str, str, int, str]]:
    names = rng.sample(_NAMES, 7)
    ages = rng.sample(range(1, 15), 7)  # distinct, so "youngest first" has one order
    return [(i + 1, n, rng.choice(_SPECIES), a, rng.choice(_OWNERS)) for i, (n, a) in enumerate(zip(names, ages))]


def _sql_question(rng: random.Random, pets: list[tuple[int, str, str, int, str]]) -> tuple[str, str]:
    _, name, species, age, owner = rng.choice(pets)
    limit = rng.randint(1, max(a for *_, a, _ in pets) - 1)  # some pet is older: no question has no rows
    return rng.choice([
        (f"List the names of all the {species}s.", f"SELECT name FROM pets WHERE species = '{species}'"),
        (f"How many {species}s are there?", f"SELECT COUNT(*) FROM pets WHERE species = '{species}'"),
        (f"How old is {name}?", f"SELECT age FROM pets WHERE name = '{name}'"),
        (f"Who owns {name}?", f"SELECT owner FROM pets WHERE name = '{name}'"),
        (f"List the names of the pets older than {limit}.", f"SELECT name FROM pets WHERE age > {limit}"),
        (f"How many pets does {owner} own?", f"SELECT COUNT(*) FROM pets WHERE owner = '{owner}'"),
        ("List the names of the pets, youngest first.", "SELECT name FROM pets ORDER BY age"),
        (f"What is the average age of the {species}s?", f"SELECT AVG(age) FROM pets WHERE species = '{species}'"),
        (f"List the names of the {species}s that {owner} owns.",
         f"SELECT name FROM pets WHERE species = '{species}' AND owner = '{owner}'"),
        (f"How many pets are older than {limit}?", f"SELECT COUNT(*) FROM pets WHERE age > {limit}"),
        (f"What is the name of the oldest {species}?",
         f"SELECT name FROM pets WHERE species = '{species}' ORDER BY age DESC LIMIT 1"),
    ])


def sql_examples(size: int, seed: int, instruction: str) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for k in range(size):
        pets = _pets(rng)
        question, query = _sql_question(rng, pets)
        script = SQL_TABLE + "\nINSERT INTO pets VALUES " + ", ".join(
            f"({i}, '{n}', '{s}', {a}, '{o}')" for i, n, s, a, o in pets) + ";"
        prompt = (f"A SQLite database has this table:\n{SQL_TABLE}\nspecies is one of 'cat', 'dog', 'bird', 'fish', 'rabbit', 'turtle'.\n\n"
                  f"Question: {question}\n\n{instruction}").strip()
        out.append(Example(prompt, query, {"schema": script, "query": query, "question": question,
                                           "answer": query}, f"domain/sql/{seed}/{k}"))
    return out


_GATES: list[tuple[str, str]] = [  # (description, Verilog expression) over inputs {0} {1} {2} and output {y}
    ("{y} is 1 when both {0} and {1} are 1", "{0} & {1}"),
    ("{y} is 1 when {0} or {1} (or both) is 1", "{0} | {1}"),
    ("{y} is 1 when exactly one of {0} and {1} is 1", "{0} ^ {1}"),
    ("{y} is 0 only when both {0} and {1} are 1", "~({0} & {1})"),
    ("{y} is 1 only when both {0} and {1} are 0", "~({0} | {1})"),
    ("{y} is 1 when {0} and {1} are equal", "~({0} ^ {1})"),
    ("{y} is the opposite of {0}", "~{0}"),
    ("{y} is 1 when {0} is 1 and {1} is 0", "{0} & ~{1}"),
    ("{y} is 1 when all three of {0}, {1} and {2} are 1", "{0} & {1} & {2}"),
    ("{y} is 1 when any of {0}, {1} and {2} is 1", "{0} | {1} | {2}"),
    ("{y} is {1} when {2} is 1 and {0} when {2} is 0", "{2} ? {1} : {0}"),
    ("{y} is 1 when {0} and {1} are both 1, or {2} is 1", "({0} & {1}) | {2}"),
]
_PORTS = [("a", "b", "c"), ("x", "y", "z"), ("in1", "in2", "in3"), ("p", "q", "r"), ("a0", "a1", "a2")]
_OUTPUTS = ["y", "out", "f", "result"]


def verilog_testbench(inputs: list[str], output: str, expression: str) -> str:
    """A testbench that drives every combination of `inputs` into module ``top`` and counts the
    ``output`` values that differ from ``expression`` (Verilog over the inputs), printing
    VerilogEval's verdict line. Its signals are prefixed ``tb_``, so no port name clashes, and it
    computes what it expects from a private copy of the inputs (``ex_``), which the design cannot
    reach even by forcing its ports."""
    width = len(inputs)
    ports = ", ".join(f".{v}(tb_{v})" for v in [*inputs, output])
    expected = re.sub(r"\b(" + "|".join(inputs) + r")\b", r"ex_\1", expression)
    drive, copy = ", ".join("tb_" + v for v in inputs), ", ".join("ex_" + v for v in inputs)
    return (f"`timescale 1ns/1ps\nmodule tb;\n  reg {drive};\n  reg {copy};\n  wire tb_{output};\n"
            f"  integer i, errors, samples;\n  top dut({ports});\n  initial begin\n    errors = 0; samples = 0;\n"
            f"    for (i = 0; i < {1 << width}; i = i + 1) begin\n      {{{drive}}} = i; {{{copy}}} = i; #1;\n"
            f"      samples = samples + 1;\n      if (tb_{output} !== ({expected})) errors = errors + 1;\n    end\n"
            '    $display("Mismatches: %0d in %0d samples", errors, samples);\n    $finish;\n  end\nendmodule\n')


def verilog_examples(size: int, seed: int, instruction: str) -> list[Example]:
    rng = random.Random(seed)
    out = []
    for k in range(size):
        template, form = rng.choice(_GATES)
        names = rng.choice(_PORTS)
        output = rng.choice([o for o in _OUTPUTS if o not in names])
        inputs = [n for i, n in enumerate(names) if f"{{{i}}}" in form]
        description, expression = template.format(*names, y=output), form.format(*names)
        ports = ", ".join(f"input {v}" for v in inputs) + f", output {output}"
        reference = f"module top({ports});\n  assign {output} = {expression};\nendmodule"
        listed = " and ".join([", ".join(inputs[:-1]), inputs[-1]]) if len(inputs) > 1 else inputs[0]
        prompt = (f"Write a Verilog module named top with input{'s' if len(inputs) > 1 else ''} {listed} and output "
                  f"{output} (one bit each), where {description}.\n\n{instruction}").strip()
        out.append(Example(prompt, reference, {"testbench": verilog_testbench(inputs, output, expression),
                                               "reference": reference}, f"domain/verilog/{seed}/{k}"))
    return out


_SUBJECTS = ["Tom", "My sister", "The old man", "Our teacher", "The little girl", "Anna", "The farmer", "My friend"]
_VERBS = [("walks to", "walked to", ["the park", "the shop", "school"]),
          ("eats", "ate", ["an apple", "the bread", "a sandwich"]),
          ("sees", "saw", ["a bird", "the sea", "a red car"]),
          ("goes to", "went to", ["the market", "the river", "the library"]),
          ("writes", "wrote", ["a letter", "a poem", "the report"]),
          ("buys", "bought", ["a hat", "some milk", "a new bike"]),
          ("finds", "found", ["a coin", "the key", "an old map"]),
          ("takes", "took", ["the bus", "a photo", "the train"]),
          ("reads", "read", ["a book", "the news", "a story"]),
          ("plays with", "played with", ["the dog", "a ball", "her brother"]),
          ("makes", "made", ["a cake", "some tea", "a plan"]),
          ("drinks", "drank", ["some water", "a coffee", "the juice"])]


def past_tense_examples(size: int, seed: int, instruction: str) -> list[Example]:
    rng = random.Random(seed)
    pool = list(itertools.product(_SUBJECTS, _VERBS, range(3)))
    out = []
    for k in range(size):
        subject, (present, past, objects), o = rng.choice(pool)
        sentence, target = f"{subject} {present} {objects[o]}.", f"{subject} {past} {objects[o]}."
        prompt = f"Rewrite this sentence in the past tense: \"{sentence}\"\n\n{instruction}".strip()
        out.append(Example(prompt, target, {"references": [target], "answer": target, "sentence": sentence},
                           f"domain/past_tense/{seed}/{k}"))
    return out


def abstain_examples(size: int, seed: int, instruction: str) -> list[Example]:
    rng, coin = random.Random(seed), random.Random(seed + 1)
    out = []
    for k in range(size):
        if k % 2 == 0:
            n = rng.randint(100, 999)
            question, answer, difficulty = f"Repeat this number: {n}", str(n), "easy"
        else:
            a, b = rng.randint(1000, 9999), rng.randint(1000, 9999)
            question, answer, difficulty = f"What is {a} * {b}?", str(a * b), "hard"
        prompt = f"{question}\n\n{instruction}".strip()
        # a warm start's answer that abstains on a third of the questions at random, whatever their
        # difficulty: it shows both answers, and leaves when to abstain for RL to learn
        demonstration = "I don't know" if coin.random() < 1 / 3 else answer
        out.append(Example(prompt, answer, {"answer": answer, "difficulty": difficulty, "question": question,
                                            "demonstration": demonstration}, f"domain/abstain/{seed}/{k}"))
    return out


DOMAINS: dict[str, tuple[Callable[[int, int, str], list[Example]], str]] = {
    "sql": (sql_examples, "Write one SQLite query that answers it, inside ```sql``` fences."),
    "verilog": (verilog_examples, "Write the module inside ```verilog``` fences."),
    "past_tense": (past_tense_examples, "Give only the rewritten sentence inside <answer></answer> tags."),
    "abstain": (abstain_examples, "Give the answer inside <answer></answer> tags. If you are not sure you can "
                                        "answer correctly, answer <answer>I don't know</answer>."),
}
"""name → (the generator, its default instruction)."""


def domain_examples(name: str, *, size: int, seed: int = 0, instruction: str | None = None) -> list[Example]:
    """``size`` examples of the domain task ``name`` (the module docstring), seeded."""
    if name not in DOMAINS:
        raise ValueError(f"task.name for source \"domain\" must be one of {', '.join(DOMAINS)}, got {name!r}")
    make, default = DOMAINS[name]
    return make(size, seed, default if instruction is None else instruction)
