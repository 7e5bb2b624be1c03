"""Game runs early against late (docs/LOG.md, issue 56): the win rate and forfeits in training
(metrics.jsonl, means over the first, middle and last three steps), each role's return, and the
held-out win rate against the fixed opponent, before and after (summary.json), with the win
rate in the games the policy did not forfeit (win rate / (1 − invalid)). For scale, the win rate
of Nim's scripted players in the policy's seat against the random opponent, over the same
held-out positions (simulated, 200 games each).

    python bench/game_runs.py runs/nim [more runs ...]
"""

from __future__ import annotations

import json
import random
import statistics
import sys
from pathlib import Path

from rlvr.agents.games import examples
from rlvr.agents.nim import Nim

KEYS = ("accuracy", "env/invalid", "env/unplayed", "env/moves", "env/return/first", "env/return/second")


def scripted_win_rate(player: str, eval_size: int, games: int = 200) -> float:
    """Nim's scripted `player` in each held-out example's role against the random opponent."""
    wins = total = 0
    rng = random.Random(0)
    for ex in examples({"game": "nim"}, eval_size):
        for _ in range(games):
            game = Nim(ex.fields["start"])
            while True:
                mover = game.to_move()
                step = game.step(Nim.scripted[player if mover == ex.fields["role"] else "random"](game, rng))
                if step.done:
                    wins += step.winner == ex.fields["role"]
                    total += 1
                    break
    return wins / total


def main() -> None:
    print(f"scripted players in the policy's seat, against random, over 128 held-out positions: random "
          f"{scripted_win_rate('random', 128):.3f}, optimal {scripted_win_rate('optimal', 128):.3f}")
    for run in map(Path, sys.argv[1:]):
        rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        middle = len(rows) // 2
        for name, part in (("first 3", rows[:3]), ("middle 3", rows[middle - 1 : middle + 2]), ("last 3", rows[-3:])):
            values = "  ".join(f"{k.removeprefix('env/')} {statistics.fmean(r.get(k, 0.0) for r in part):+.3f}"
                               for k in KEYS)
            print(f"{run.name} steps {name}: {values}")
        summary = json.loads((run / "summary.json").read_text())
        for when in ("eval_before", "eval_after"):
            e = summary[when]
            invalid = e.get("eval/env/invalid", 0.0)
            kept = e["eval/accuracy"] / (1 - invalid) if invalid < 1 else float("nan")
            print(f"{run.name} {when}: win rate {e['eval/accuracy']:.3f}  invalid {invalid:.3f}  "
                  f"win rate without its forfeits {kept:.3f}  moves {e.get('eval/env/moves', 0):.2f}")


if __name__ == "__main__":
    main()
