"""Hold the verilog reward against VerilogEval v2's own problems (NVlabs/verilog-eval,
dataset_spec-to-rtl): every reference solution, renamed to the TopModule the testbench expects,
must pass its testbench, none may be refused by the reward's static check, and a broken copy of
each (one operator flipped) must fail wherever the flip changes behaviour.

    python bench/verilog_eval.py /path/to/verilog-eval/dataset_spec-to-rtl

The dataset is not shipped with rlvr (nor on PyPI); clone the repository to run this.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

from rlvr.rewards.verilog import refusal, verilog_group_reward

_FLIPS = [("&", "|"), ("|", "&"), ("^", "~^"), ("+", "-"), ("<=", ">="), ("==", "!="), ("1'b1", "1'b0"),
          ("1'b0", "1'b1")]


def broken(design: str) -> str | None:
    """The design with its first flippable operator, in the first assign/always body, flipped."""
    body_start = re.search(r"\b(assign|always|always_comb|always_ff)\b", design)
    if body_start is None:
        return None
    head, body = design[: body_start.start()], design[body_start.start():]
    for old, new in _FLIPS:
        if old in body:
            return head + body.replace(old, new, 1)
    return None


def main(folder: str) -> None:
    problems = sorted(Path(folder).glob("*_ref.sv"))
    passed, refused, failures, mutants, killed = 0, [], [], 0, 0
    start = time.time()
    for ref in problems:
        name = ref.name.removesuffix("_ref.sv")
        reference = ref.read_text().replace("module RefModule", "module TopModule")
        testbench = (ref.parent / f"{name}_test.sv").read_text() + "\n" + ref.read_text()
        why = refusal(reference)
        if why:
            refused.append((name, why))
        candidates = [f"```verilog\n{reference}\n```"]
        bad = broken(reference)
        if bad is not None:
            candidates.append(f"```verilog\n{bad}\n```")
        scores = verilog_group_reward("", candidates, testbench=testbench, top="tb", timeout_s=30)
        if float(scores[0]) == 1.0:
            passed += 1
        else:
            failures.append((name, float(scores[0]), getattr(scores[0], "info", None)))
        if bad is not None:
            mutants += 1
            killed += float(scores[1]) < 1.0
    print(f"{len(problems)} problems in {time.time() - start:.0f} s: {passed} references pass, "
          f"{len(refused)} refused by the static check, {killed}/{mutants} broken copies fail")
    for item in refused + failures:
        print("  ", item)


if __name__ == "__main__":
    main(sys.argv[1])
