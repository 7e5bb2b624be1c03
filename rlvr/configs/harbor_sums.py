"""Harbor task directories for configs/harbor_sums.toml and the tests: one-digit sums whose answer
goes in a file, laid out as Harbor lays a task out (instruction.md, task.toml, environment/,
tests/test.sh, solution/solve.sh):

    python -m rlvr.configs.harbor_sums harbor-sums 200     # 200 tasks in ./harbor-sums

Task k asks for a + b (drawn from k) in /app/answer.txt; with ``--from-file`` the numbers are in
/app/numbers.txt, put there by the Dockerfile's COPY. The verifier knows the sum itself: it never
reads a file the agent could rewrite (the numbers), only the answer. Reward 1 for the right sum,
0.1 for an answer file with another (a format credit: the bundled model rarely writes a file at
first, docs/LOG.md), 0 for none.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

TASK_TOML = """schema_version = "1.4"

[task]
name = "rlvr/{name}"
description = "Write a one-digit sum to /app/answer.txt"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
workdir = "/app"
network_mode = "no-network"
cpus = 1
memory_mb = 512
"""

TEST_SH = """#!/bin/bash
# Harbor's verifier contract: leave the reward in /logs/verifier/reward.json (or reward.txt).
mkdir -p /logs/verifier
answer="$(tr -d '[:space:]' < /app/answer.txt 2>/dev/null)"
if [ -f /app/answer.txt ]; then exists=1; else exists=0; fi
if [ "$answer" = "{total}" ]; then reward=1; elif [ "$exists" = 1 ]; then reward=0.1; else reward=0; fi
echo "{{\\"reward\\": $reward, \\"answer_file\\": $exists}}" > /logs/verifier/reward.json
"""


def write_task(folder: Path, k: int, from_file: bool = False) -> Path:
    a, b = random.Random(k).randint(0, 9), random.Random(k + 10**6).randint(0, 9)
    name = f"sum-{k:04d}"
    task = folder / name
    (task / "environment").mkdir(parents=True, exist_ok=True)
    (task / "tests").mkdir(exist_ok=True)
    (task / "solution").mkdir(exist_ok=True)
    (task / "task.toml").write_text(TASK_TOML.format(name=name))
    dockerfile = "FROM python:3.12-slim\nWORKDIR /app\n"
    if from_file:
        (task / "environment" / "numbers.txt").write_text(f"{a}\n{b}\n")
        dockerfile += "COPY numbers.txt /app/numbers.txt\n"
        instruction = "The file /app/numbers.txt holds two numbers, one per line. Write their sum to /app/answer.txt."
    else:
        instruction = f"What is {a} + {b}? Write the answer to the file /app/answer.txt."
    (task / "environment" / "Dockerfile").write_text(dockerfile)
    (task / "instruction.md").write_text(instruction + "\n")
    (task / "tests" / "test.sh").write_text(TEST_SH.format(total=a + b))
    solve = ("python3 -c 'print(sum(int(x) for x in open(\"/app/numbers.txt\").read().split()))'" if from_file
             else f"echo {a + b}")
    (task / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solve} > /app/answer.txt\n")
    for script in (task / "tests" / "test.sh", task / "solution" / "solve.sh"):
        script.chmod(0o755)
    return task


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("count", type=int)
    parser.add_argument("--from-file", action="store_true", help="the numbers in /app/numbers.txt (a COPY)")
    args = parser.parse_args()
    for k in range(args.count):
        write_task(args.folder, k, args.from_file)
    print(f"{args.count} Harbor tasks in {args.folder}")


if __name__ == "__main__":
    main()
