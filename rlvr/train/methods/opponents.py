"""The opponent pool of a game (rlvr.agents.games): the policy as the run began, then a snapshot every
`env.kwargs.pool_every` steps, which the game's frozen and pool opponents play.

Each snapshot is kept on the CPU for the games and written to the run directory
(``opponents/step-<k>.safetensors``) as it is taken; the checkpoint records which steps the pool
holds, and a resumed run reads them back, so it plays the same opponents. A snapshot dropped
from the pool (beyond `pool_size`) keeps its file, since a checkpoint kept from before may list
it: the directory grows by one copy of the weights per snapshot (the bundled model: 326 MB in
bf16).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors.torch import load_file, save_file

from rlvr.agents.games import Options, Pool
from rlvr.algos import ESTIMATORS
from rlvr.algos.advantages import wants_greedy
from rlvr.lora import merged_state_dict
from rlvr.train.methods.base import Method, SetupInfo

if TYPE_CHECKING:
    from rlvr.config import RunConfig
    from rlvr.train.run import Run


class Opponents(Method):
    state_key = "opponents"
    state_required = True
    """A resumed game without its pool would have no opponents to play."""

    def __init__(self, pool: Pool, directory: Path) -> None:
        self.pool, self.directory = pool, directory

    def take(self, run: Run, step: int) -> None:
        """The learner's policy now, as the pool's snapshot after ``step``."""
        weights = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in
                   merged_state_dict(run.learner.model).items()}
        self.directory.mkdir(parents=True, exist_ok=True)
        save_file(weights, str(self._file(step)))
        # a snapshot dropped from the pool keeps its file: an earlier checkpoint may still list it
        self.pool.add(step, weights)

    def _file(self, step: int) -> Path:
        return self.directory / f"step-{step}.safetensors"

    def after_update(self, run: Run, plan: Any, metrics: dict[str, float], step: int) -> dict[str, float]:
        if self.pool.every and step >= max(self.pool.weights) + self.pool.every:  # (a skipped step took none)
            self.take(run, step)
        return {"opponents/pool": float(len(self.pool.weights)), "opponents/newest": float(max(self.pool.weights))}

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.pool.steps()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pool.weights.clear()
        for step in state["steps"]:
            path = self._file(int(step))
            if not path.exists():
                raise FileNotFoundError(f"the opponent pool's snapshot {path} is missing: the run directory lost it, "
                                        "so the run cannot resume with the same opponents")
            self.pool.add(int(step), load_file(str(path)))


def build(run: Run, info: SetupInfo) -> Method | None:
    pool = getattr(run.task.episodes, "pool", None)
    if pool is None:
        return None
    method = Opponents(pool, run.dir / "opponents")
    if not info.resuming:
        method.take(run, 0)
    return method


def check(cfg: RunConfig) -> None:
    """A game's opponents, beside the rest of the run: self-play trains several roles, so a prompt
    gives several groups, which only plain collection takes; frozen and pool opponents run on a
    copy of the policy in this process."""
    if cfg.env.name != "game":
        return
    options = Options.of(dict(cfg.env.kwargs))
    if options.trains_every_role and cfg.sampler.rollouts != "plain":
        raise ValueError(f"env.kwargs.opponent = \"self\" trains every role, one group per prompt and role; "
                         f"sampler.rollouts = {cfg.sampler.rollouts!r} counts one group per prompt: use \"plain\"")
    estimator = ESTIMATORS.get(cfg.algo.advantage)
    if options.trains_every_role and estimator is not None and wants_greedy(estimator):
        raise ValueError(f"env.kwargs.opponent = \"self\" gives one group per prompt and role; advantage = "
                         f"{cfg.algo.advantage!r} samples one greedy baseline per prompt: use a group baseline")
    if options.needs_pool() and (cfg.engine.backend != "embedded" or cfg.dist.rollout_workers):
        raise ValueError("env.kwargs.opponent = \"frozen\" or \"pool\" (or eval_opponent = \"frozen\") plays earlier "
                         "policies on a copy of the model in the training process: it needs the embedded engine "
                         "without rollout workers (use a scripted opponent or self-play there)")

