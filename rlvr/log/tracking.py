"""Experiment trackers beside metrics.jsonl: TensorBoard, Weights & Biases, MLflow.

Chosen with ``log.sinks = ["tensorboard", "wandb", "mlflow"]``; each is an optional extra
(``pip install 'rlvr[tensorboard]'`` ...), checked when the run starts so that a missing package
fails before any compute is spent. metrics.jsonl stays the record: a tracker that fails mid-run
(a network error, a full disk) is reported once and switched off, and training goes on.

Resuming a run continues the same tracker run: TensorBoard purges events after the resumed
step, W&B and MLflow reuse the run id kept in ``<run>/trackers.json``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import uuid
import warnings
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from pathlib import Path
from typing import Any, Literal, Protocol

from rlvr.algos.registry import check_keywords
from rlvr.errors import MissingExtra

SINKS = ("tensorboard", "wandb", "mlflow")
# sink → (module that must import, the extra that installs it)
_REQUIRES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
             "mlflow": ("mlflow", "mlflow")}
STATE_FILE = "trackers.json"
INIT_TIMEOUT_S = 30
"""The longest W&B may take to start a run before the start fails (its own default is 90 s)."""


def import_extra(module: str, message: str) -> Any:
    """The module, or MissingExtra(message) when it is not installed (message: what needs it and
    the install line)."""
    try:
        return import_module(module)
    except ImportError as e:
        raise MissingExtra(message) from e


class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self, outcome: Outcome = "finished") -> None: ...


Outcome = Literal["finished", "failed", "interrupted"]
"""How the run ended, for a tracker's run status: trained to its end, stopped by an error, or
stopped by Ctrl-C (a graceful stop included; it resumes)."""


class TrackerError(RuntimeError):
    """A tracker the config names could not start (its server unreachable, its files unwritable):
    the run stops before any compute is spent, naming it."""


def require(name: str) -> None:
    """Raise MissingExtra naming the extra to install when a sink's package is missing."""
    if name not in _REQUIRES:
        raise ValueError(f"unknown log sink {name!r}; choose from {', '.join(SINKS)}")
    module, extra = _REQUIRES[name]
    import_extra(module, f"log.sinks includes {name!r} but the {module} package is not installed: "
                         f"pip install 'rlvr[{extra}]'")


def numeric(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of a metrics row (trackers take floats; strings and NaN are left to JSONL)."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        if math.isfinite(value):
            out[key] = float(value)
    return out


class TensorBoard:
    """Scalars under ``<run>/tensorboard``; ``tensorboard --logdir runs`` shows every run."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], state: dict[str, Any],
                 start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # purge_step drops events a crashed run wrote after its last checkpoint
        self.writer = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self, outcome: Outcome = "finished") -> None:
        self.writer.close()


class WandB:
    """One W&B run per rlvr run (the id is kept for resuming), in W&B project ``project``.
    ``mode = "offline"`` writes to ``<run>/wandb`` for a later ``wandb sync``; unset, W&B's own
    setting (``WANDB_MODE``, ``wandb login``) decides ("online", "offline", "disabled")."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], state: dict[str, Any],
                 start_step: int, *, project: str = "rlvr", mode: str | None = None) -> None:
        import wandb

        state.setdefault("wandb_id", uuid.uuid4().hex[:12])
        # a server that cannot be reached fails the start in INIT_TIMEOUT_S (W&B's own wait is 90 s)
        settings = wandb.Settings(silent=True, init_timeout=INIT_TIMEOUT_S)
        self.run = wandb.init(project=project, name=name, id=state["wandb_id"], resume="allow", dir=str(run_dir),
                              config=config, mode=mode, settings=settings)  # type: ignore[arg-type]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self, outcome: Outcome = "finished") -> None:
        self.run.finish(exit_code={"finished": 0, "failed": 1, "interrupted": 130}[outcome])


_MLFLOW_BAD = re.compile(r"[^A-Za-z0-9_\-. :/]")


def mlflow_key(key: str) -> str:
    """MLflow metric names allow letters, digits and ``_-. :/``: pass@4 → pass_at_4."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MLflow:
    """One MLflow run per rlvr run, in MLflow experiment ``experiment``. ``uri`` unset means a
    local file store in ``<run>/mlruns`` (``mlflow ui --backend-store-uri <run>/mlruns``); set it
    to a tracking server (``http://host:5000``) or a database URI."""

    def __init__(self, run_dir: Path, name: str, config: dict[str, Any], state: dict[str, Any],
                 start_step: int, *, uri: str | None = None, experiment: str = "rlvr") -> None:
        if uri is None:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store for local use but asks for an explicit opt-in
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        elif uri.startswith(("http://", "https://")):
            # a server that cannot be reached: MLflow's own retries wait ~4 minutes before failing a
            # request; these fail the start (and switch the tracker off mid-run) within a minute
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self.client = MlflowClient(tracking_uri=uri)
        if "mlflow_run_id" not in state:
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=name)
            state["mlflow_run_id"] = run.info.run_id
            params = [Param(k, str(v)[:6000]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(run.info.run_id, params=params[i : i + 100])
        self.run_id = state["mlflow_run_id"]

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def close(self, outcome: Outcome = "finished") -> None:
        self.client.set_terminated(self.run_id, status={"finished": "FINISHED", "failed": "FAILED",
                                                        "interrupted": "KILLED"}[outcome])


def _flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


class Trackers:
    """Fans a metrics row out to the configured trackers. A tracker that raises is reported
    (``warn``) and dropped; metrics.jsonl has every row regardless."""

    def __init__(self, trackers: dict[str, Tracker], warn: Callable[[str], None] | None = None) -> None:
        self.trackers, self.warn = trackers, warn or (lambda text: warnings.warn(text, stacklevel=2))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        values = numeric(metrics)
        for name, tracker in list(self.trackers.items()):
            try:
                tracker.log(step, values)
            except Exception as e:  # noqa: BLE001 - a tracker must not stop training
                self.warn(f"log sink {name} failed and is switched off ({type(e).__name__}: {e}); "
                          "metrics.jsonl keeps every row")
                self.trackers.pop(name)
                with contextlib.suppress(Exception):  # its writer or run is not left open until exit
                    tracker.close("failed")

    def close(self, outcome: Outcome = "finished") -> None:
        """Close every tracker, each told how the run ended (its status: a crashed run is not
        "finished" in MLflow or W&B)."""
        for name, tracker in self.trackers.items():
            try:
                tracker.close(outcome)
            except Exception as e:  # noqa: BLE001
                self.warn(f"log sink {name} failed to close ({type(e).__name__}: {e})")
        self.trackers = {}


TRACKERS: dict[str, Callable[..., Tracker]] = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
"""Each sink's tracker: ``cls(run_dir, name, config, state, start_step, **log.sink_kwargs[sink])``."""


def check_sink_kwargs(sinks: Sequence[str], kwargs: Mapping[str, Mapping[str, Any]]) -> None:
    """Raise a ValueError for settings of a sink not in ``sinks`` or a keyword its tracker does not take."""

    for sink, given in kwargs.items():
        if sink not in sinks:
            raise ValueError(f"log.sink_kwargs.{sink} configures a sink log.sinks does not name "
                             f"(log.sinks = {list(sinks)})")
        check_keywords(f"log.sink_kwargs.{sink}", TRACKERS[sink], given)
        if sink == "wandb" and given.get("mode") not in (None, "online", "offline", "disabled"):
            raise ValueError(f"log.sink_kwargs.wandb: mode must be \"online\", \"offline\" or \"disabled\" "
                             f"(got {given['mode']!r})")


def open_trackers(sinks: Sequence[str], run_dir: Path, *, name: str, config: dict[str, Any], start_step: int,
                  kwargs: Mapping[str, Mapping[str, Any]] | None = None,
                  warn: Callable[[str], None] | None = None) -> Trackers:
    """Start the trackers named in ``sinks`` for the run in ``run_dir``, each with its ``kwargs[sink]``
    (MissingExtra naming the extra when a package is missing)."""
    for sink in sinks:
        require(sink)
    kwargs = kwargs or {}
    check_sink_kwargs(sinks, kwargs)
    say = warn or (lambda text: warnings.warn(text, stacklevel=2))
    state_path = run_dir / STATE_FILE
    state: dict[str, Any] = {}
    if state_path.exists():
        try:
            state = json.loads(state_path.read_text())
        except (UnicodeDecodeError, ValueError) as err:  # cut off by a kill before it was written atomically
            say(f"{state_path} is not readable JSON ({err}): the trackers start new runs of their own")
    opened: dict[str, Tracker] = {}
    for sink in dict.fromkeys(sinks):
        try:
            opened[sink] = TRACKERS[sink](run_dir, name, config, state, start_step, **kwargs.get(sink, {}))
        except Exception as err:  # noqa: BLE001 - any failure to start, said with the sink's name
            Trackers(opened, say).close("failed")
            raise TrackerError(f"log sink {sink} could not start ({type(err).__name__}: {str(err)[:300]}): fix it, "
                               f"or leave {sink!r} out of log.sinks (metrics.jsonl keeps every row)") from err
    if state:
        tmp = state_path.with_suffix(".json.tmp")  # whole or not at all: a torn file stopped every resume
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(state_path)
    return Trackers(opened, warn)
