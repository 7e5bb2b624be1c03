"""Stored samples of the initial policy, for the divergence terms of DPH-RL (rlvr.algos.divergence).

Its knobs are `algo.divergence_kwargs` (RehearsalOptions below). Before the first update, the
initial policy answers each screened training prompt `k` times. A
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
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlvr.algos import DIVERGENCES, aggregate_loss
from rlvr.options import RehearsalOptions
from rlvr.data.images import with_prompt_media
from rlvr.errors import RunDirError
from rlvr.log import ScreeningProgress
from rlvr.train.data import TaskData
from rlvr.train.batches import score_logprobs, scored_batches, token_rows
from rlvr.train.learner import Learner
from rlvr.train.methods.base import Method, SetupInfo, Plan
from rlvr.train.rollouts import generate_groups, is_correct
from rlvr.train.settings import UpdateSettings
from rlvr.types import Completion, Sample

if TYPE_CHECKING:
    from rlvr.train.run import Run

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


@dataclasses.dataclass(frozen=True)
class Divergence:
    """The step's LossTerm: coef · (token mean of the divergence D(π_0 ‖ π_θ) over a batch of
    stored samples), added to every optimizer step's gradient."""

    samples: list[Sample]
    name: str
    """The divergence, by name (rlvr.algos.DIVERGENCES)."""
    coef: float

    def add(self, learner: Learner, s: UpdateSettings, pad_token_id: int, device: torch.device,
            sums: dict[str, float]) -> None:
        total = float(sum(x.completion.trainable() for x in self.samples))
        for micro, batch, logprobs_BT in scored_batches(learner.model, self.samples, s, pad_token_id, device):
            mask_BT, where_BT = batch["loss_mask"], batch["completion_mask"]
            init_BT = token_rows([torch.tensor(self.samples[i].completion.logprobs, dtype=torch.float32)
                                  for i in micro], list(range(len(micro))), where_BT)
            div_BT, div_metrics = DIVERGENCES[self.name](logprobs_BT, init_BT, mask_BT)
            div = aggregate_loss(div_BT, mask_BT, mode="token-mean", total_tokens=total)
            (self.coef * div).backward()
            n = float(mask_BT.sum())
            sums["_divergence_tokens"] += n
            sums["divergence"] += float(div.detach()) * total  # the micro-batch's share of the token sum
            for key, value in div_metrics.items():
                sums[key] += float(value) * n

    def summarise(self, sums: dict[str, float]) -> dict[str, float]:
        """The divergence and its metrics, as means over the rehearsed tokens."""
        tokens = sums.pop("_divergence_tokens", 0.0)
        return {key: sums.pop(key) / tokens for key in [k for k in sums if k.startswith("divergence")]}


class Rehearse(Method):
    """Each update adds the divergence on the next `batch` stored samples."""

    state_key = "rehearsal"

    def __init__(self, rehearsal: Rehearsal, divergence: str, options: RehearsalOptions) -> None:
        self.rehearsal, self.divergence, self.options = rehearsal, divergence, options

    def task(self, task: TaskData) -> TaskData:
        """With `exclude`, RL trains on what the initial policy could not already solve."""
        if not self.options.exclude:
            return task
        solved = self.rehearsal.prompt_indices
        examples = [ex for i, ex in enumerate(task.examples) if i not in solved]
        if not examples:
            raise ValueError(f"every training prompt joined the rehearsal set ({self.rehearsal.screened} screened), "
                             "so none is left for RL; raise task.size or algo.divergence_kwargs.min_correct, or "
                             "set algo.divergence_kwargs.exclude = false")
        return dataclasses.replace(task, examples=examples,
                                   prompt_ids=[ids for i, ids in enumerate(task.prompt_ids) if i not in solved],
                                   media=None if task.media is None else
                                   [m for i, m in enumerate(task.media) if i not in solved])

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        term = Divergence(self.rehearsal.next_batch(self.options.batch), self.divergence, self.options.coef)
        return dataclasses.replace(plan, extras=dataclasses.replace(plan.extras, terms=(*plan.extras.terms, term)))

    def metrics(self, run: Run) -> dict[str, float]:
        return {"rehearsal_size": len(self.rehearsal.samples)}

    def state_dict(self) -> dict[str, Any]:
        return self.rehearsal.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.rehearsal.load_state_dict(state)


def screen(run: Run, info: SetupInfo, o: RehearsalOptions) -> Rehearsal:
    """The run's rehearsal set: read back from the run directory, or screened now with the initial policy."""
    if (run.dir / FILE).is_file():
        rehearsal = Rehearsal.load(run.dir)
        if run.task.media is not None:  # the file keeps ids, not images: they are the (unfiltered) task's
            rehearsal.samples = with_prompt_media(rehearsal.samples, run.task.media)
        return rehearsal
    if info.resuming:
        raise RunDirError(f"{run.dir} has no {FILE}: algo.divergence needs samples of the initial policy, "
                                  "which a resumed run no longer has; start a new run to use it")
    task, engine = run.task, run.engine
    order = screen_order(len(task.examples), o.prompts, run.cfg.seed)
    with ScreeningProgress(len(order), o.k, disable=info.quiet) as progress:
        groups = generate_groups(engine, task.examples, task.prompt_ids, order, task.rewards,
                                 dataclasses.replace(task.params, n=o.k), progress=progress.advance, media=task.media)
        primary = task.rewards[0].name
        needed = o.min_correct or o.k
        keep = [next(x for x in g.samples if is_correct(x, primary)) for g in groups
                if sum(is_correct(x, primary) for x in g.samples) >= needed]
        progress.report(len(keep), needed)
    # log π_0 as the learner computes it (the engine's are after top-k/top-p, and in its dtype)
    init = score_logprobs(run.learner.model, keep, run.settings, engine.pad_token_id, set(range(len(keep))))
    samples = [dataclasses.replace(x, completion=dataclasses.replace(x.completion, logprobs=tuple(lp.tolist())))
               for x, lp in zip(keep, init)]
    rehearsal = Rehearsal(samples, screened=len(order))
    rehearsal.save(run.dir)
    return rehearsal


def build(run: Run, info: SetupInfo) -> Method | None:
    a = run.cfg.algo
    if a.divergence == "none":
        return None
    options = a.divergence_options()
    return Rehearse(screen(run, info, options), a.divergence, options)
