"""Stored samples of the initial policy, for the divergence terms of DPH-RL (rlvr.algos.divergence).

Before the first update, the initial policy answers each screened training prompt `k` times. A
prompt it answers correctly every time (or at least `min_correct` times) goes to the rehearsal
set (DPH-RL's "perfect" set D_pef), with one of its correct completions and that completion's
log-probs under the initial policy; the rest (D_exp) are what RL trains on when `exclude` is set,
as in the paper. Each update then adds
`coef · D(π_0 ‖ π_θ)` estimated on a batch of the stored samples. No reference model is kept.

Li et al., "The Choice of Divergence: A Neglected Key to Mitigating Diversity Collapse in
Reinforcement Learning with Verifiable Reward", arXiv:2509.07430 (their code screens with 4-8
samples and stores one correct response per prompt).

The set is written to `<run>/rehearsal.jsonl` once and read back on resume, so a resumed run
rehearses exactly the same samples; the position in it is part of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from rlvr.types import Completion, Sample

FILE = "rehearsal.jsonl"


@dataclasses.dataclass
class Rehearsal:
    """The stored samples (``completion.logprobs`` are log π_0 as the learner computes them)."""

    samples: list[Sample]
    screened: int
    """How many prompts were screened."""
    position: int = 0

    @property
    def prompt_indices(self) -> set[int]:
        return {s.prompt_index for s in self.samples}

    def next_batch(self, n: int) -> list[Sample]:
        """The next `n` stored samples, cycling through the set; never the same one twice in a
        batch (a set smaller than `n` is returned whole)."""
        n = min(n, len(self.samples))
        out = [self.samples[(self.position + k) % len(self.samples)] for k in range(n)]
        self.position += n
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = int(state["position"])

    def save(self, run_dir: Path) -> None:
        tmp = Path(run_dir) / (FILE + ".tmp")
        with tmp.open("w") as f:
            f.write(json.dumps({"screened": self.screened}) + "\n")
            for s in self.samples:
                f.write(json.dumps({"prompt_index": s.prompt_index, "prompt_ids": list(s.prompt_ids),
                                    "token_ids": list(s.completion.token_ids), "init_logprobs": list(s.completion.logprobs),
                                    "text": s.completion.text, "reward": s.reward}) + "\n")
        tmp.replace(Path(run_dir) / FILE)

    @classmethod
    def load(cls, run_dir: Path) -> Rehearsal:
        path = Path(run_dir) / FILE
        lines = path.read_text().splitlines()
        if not lines:
            raise ValueError(f"{path} is empty; delete it to screen the prompts again")
        header, rows = json.loads(lines[0]), [json.loads(line) for line in lines[1:]]
        samples = [Sample(tuple(r["prompt_ids"]), Completion(tuple(r["token_ids"]), tuple(r["init_logprobs"]), "stop",
                                                             r["text"]), r["reward"], {}, r["prompt_index"])
                   for r in rows]
        return cls(samples, int(header["screened"]))


def screen_order(num_prompts: int, limit: int, seed: int) -> list[int]:
    """Which training prompts to screen: `limit` of them in a seeded order (all when limit is 0)."""
    order = np.random.default_rng([seed, 7]).permutation(num_prompts).tolist()
    return order if limit == 0 else order[:limit]
