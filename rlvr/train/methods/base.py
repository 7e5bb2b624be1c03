"""The seams a training method plugs into (rlvr.train.methods has the registry and the story):
`Method`'s hooks, the `Plan` an update runs, the `Extras` a method adds to it, and what a
method's factory is told (`SetupInfo`, and `RankInfo` on a learner rank). Below every method's
module, which imports these and never the registry above it."""


from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlvr.data import Example
from rlvr.data.images import image_token_ids
from rlvr.train.data import TaskData
from rlvr.train.update import Extras, UpdateSettings
from rlvr.types import Group, SamplingParams

if TYPE_CHECKING:
    from rlvr.train.run import Run


@dataclass(frozen=True)
class Plan:
    """One step's update, as the methods prepared it."""

    groups: list[Group]
    """What the update trains on: this step's groups, then any replayed ones."""
    own: list[Group]
    """This step's groups as the policy sampled them: the sampler observes these, with the update's
    per-sample results (`UpdateResult.outcomes`)."""
    settings: UpdateSettings
    extras: Extras = field(default_factory=Extras)


@dataclass(frozen=True)
class SetupInfo:
    """What a method's factory may need beyond the run's parts."""

    device: torch.device
    dtype: torch.dtype
    """The learner's."""
    optimizer_steps: int
    """The learning-rate schedule's length."""
    resuming: bool
    quiet: bool


@dataclass(frozen=True)
class RankInfo:
    """What a learner rank's parts are built from, beside the config and the rank's policy."""

    optimizer_steps: int
    """The learning-rate schedule's length (a critic's optimizer follows it)."""
    tokenizer: Any
    fields_of: Callable[[Group], dict[str, Any]] | None = None
    """The fields of a group's example (what a function PRM reads: rlvr.train.methods.process)."""
    banned: bool = False
    """The engine never samples some tokens (a VLM's image placeholders): its distribution is truncated."""

    @classmethod
    def of(cls, run: Run, info: SetupInfo) -> RankInfo:
        """The local run's: what its methods' factories build their parts from."""
        return cls(info.optimizer_steps, run.tokenizer, example_fields(fields_by_id(run.task.examples)),
                   bool(image_token_ids(run.processor)))


class Method:
    """A method's seams (see the module docstring); every hook is a no-op here."""

    state_key: str | None = None
    """The checkpoint's key for this method's state (None: it keeps none)."""
    state_required = False
    """A checkpoint without this method's state cannot be resumed with it (else it starts fresh)."""

    def task(self, task: TaskData) -> TaskData:
        return task

    def sampling(self, params: SamplingParams, step: int) -> SamplingParams:
        return params

    def rescore(self, run: Run, groups: list[Group], examples: list[Example], held_out: bool) -> list[Group]:
        return groups

    def prepare(self, run: Run, plan: Plan, step: int) -> Plan:
        return plan

    def after_update(self, run: Run, plan: Plan, metrics: dict[str, float], step: int) -> dict[str, float]:
        return {}

    def metrics(self, run: Run) -> dict[str, float]:
        return {}

    def save_after(self, step: int) -> bool:
        """Whether the run keeps a checkpoint after this step, whatever checkpoint_every says (a
        method that did long work in it, which a crash would otherwise lose)."""
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def example_fields(fields_by_id: Mapping[Any, Mapping[str, Any]]) -> Callable[[Group], dict[str, Any]]:
    """``fields_of(group)``: the fields of the group's example, looked up by its id in
    ``fields_by_id`` when called (a data-parallel rank's mapping is refilled each update), what a
    function PRM receives as keywords; a group of no known example gets its answer alone."""
    def fields_of(group: Group) -> dict[str, Any]:
        fields = fields_by_id.get(group.metadata.get("id"))
        return dict(fields) if fields is not None else {"answer": group.metadata.get("answer")}

    return fields_of


def fields_by_id(examples: Iterable[Any]) -> dict[Any, Mapping[str, Any]]:
    """Each example's fields, by its id (`example_fields`)."""
    return {ex.id: ex.fields for ex in examples}
