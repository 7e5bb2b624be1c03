"""Reading configs (TOML files, dotted overrides), the errors that say what and where, writing a
run's config.toml, and the `rlvr config` listing."""

from __future__ import annotations

import difflib
import tomllib
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from rlvr import __version__
from rlvr.config import ROOTS, RunConfig
from rlvr.config.sections import ConfigError, RewardConfig

def _known_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    keys = []
    for name, field in model.model_fields.items():
        keys.append(prefix + name)
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            keys += _known_keys(sub, prefix + name + ".")
    return keys


def _check_keys(data: dict[str, Any], model: type[BaseModel], where: str, prefix: str = "",
                root: type[RunConfig] | None = None) -> None:
    """Reject unknown keys with the nearest valid one, before pydantic sees the data."""
    root = root or RunConfig
    for key, value in data.items():
        full = prefix + key
        if key not in model.model_fields:
            if isinstance(value, dict) and value:  # a section gone: its first key may have moved
                full += "." + next(iter(value))
            raise ConfigError(f"{where}: {_unknown(full, [prefix + k for k in model.model_fields], root)}")
        sub = model.model_fields[key].annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: '{full}' is a section; set its keys, e.g. {full}.<key>=...")
            _check_keys(value, sub, where, full + ".", root)
        elif key == "rewards" and isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    _check_keys(item, RewardConfig, where, f"rewards[{i}].", root)


def _unknown(full: str, siblings: list[str], root: type[RunConfig]) -> str:
    """Why `full` is not a key of `root`: another command's section, a key that moved, or the nearest one."""
    owner = next((c for c, r in ROOTS.items() if full.split(".")[0] in r.model_fields and r is not root), None)
    if owner and full.split(".")[0] not in root.model_fields:
        return f"[{full.split('.')[0]}] belongs to `rlvr {owner}`'s config, not `rlvr {root.command}`'s"
    if full in MOVED:
        return f"'{full}' is now {MOVED[full]}"
    known = _known_keys(root)
    synonym = SYNONYMS.get(full.rsplit(".", 1)[-1])
    section = full.rsplit(".", 1)[0] + "." if "." in full else ""
    named = [k for k in known if synonym and (k == synonym or k.endswith("." + synonym))]
    # another trainer's name for a key of this section, then the nearest spelling, then the name elsewhere
    near = [k for k in named if k.startswith(section)][:1]
    near = near or difflib.get_close_matches(full, siblings + known, n=1, cutoff=0.5) or named[:1]
    hint = f"; did you mean '{near[0]}'?" if near else ""
    return f"unknown config key '{full}'{hint} (`rlvr config {root.command}` lists all keys)"


SYNONYMS: dict[str, str] = {
    "learning_rate": "lr", "num_generations": "group_size", "max_steps": "steps", "beta": "kl_coef",
    "max_completion_length": "max_new_tokens", "max_tokens": "max_new_tokens",
    "per_device_train_batch_size": "micro_batch_size", "num_train_epochs": "epochs",
}
"""Names other trainers (TRL's GRPOConfig, OpenAI's API) give rlvr's keys, for the unknown-key hint."""

MOVED: dict[str, str] = {
    **{f"expert.{k}": f"expert.kwargs.{k} (with mode = \"chord\")"
       for k in ("mu_peak", "mu_valley", "mu_warmup_steps", "mu_decay_steps", "weighting")},
    "algo.divergence_coef": "algo.divergence_kwargs.coef",
    "algo.entropy_coef": "algo.entropy.coef",
    **{f"algo.rehearsal_{k}": f"algo.divergence_kwargs.{k}" for k in ("prompts", "k", "min_correct", "batch", "exclude")},
    **{f"rlp.{k}": f"task.params.{k} (task.source = \"text\")" for k in ("context_chars", "target_words",
                                                                         "min_context_words")},
    **{f"rlp.{k}": f"the kwargs of the information_gain reward: rewards = [{{fn = \"information_gain\", kwargs = "
                   f"{{{k} = ...}}}}]" for k in ("think_open", "think_close", "ema_decay")},
    **{f"sampler.replay_{k}": f"sampler.replay.{k}" for k in ("fraction", "capacity", "max_age")},
    "env.mask_unfinished": "env.mask = [\"unfinished\"]",
    "env.summarize_at": "env.summarize.at", "env.summary_rounds": "env.summarize.rounds",
    "env.summary_tokens": "env.summarize.max_tokens", "env.summary_instruction": "env.summarize.instruction",
    "expert.relift_batch": "expert.kwargs.batch (with mode = \"relift\")",
    "expert.relift_max_accuracy": "expert.kwargs.max_accuracy (with mode = \"relift\")",
    **{f"algo.{k}": f"algo.loss_kwargs.{k}" for k in ("clip_low", "clip_high", "dual_clip")},
    "algo.kl_target": "algo.kl_adaptive.target", "algo.kl_horizon": "algo.kl_adaptive.horizon",
    **{f"dist.{k}": f"dist.ray.{k}" for k in ("address", "num_cpus", "cpus_per_worker", "gpus_per_learner",
                                              "gpus_per_worker", "threads_per_worker", "timeout_s")},
    "dist.async_steps": "dist.async_rollouts.steps",
    **{f"dist.{k}": f"dist.async_rollouts.{k}" for k in ("max_staleness", "on_stale", "partial_rollouts")},
    "log.wandb_project": "log.sink_kwargs.wandb.project", "log.wandb_mode": "log.sink_kwargs.wandb.mode",
    "log.mlflow_uri": "log.sink_kwargs.mlflow.uri", "log.mlflow_experiment": "log.sink_kwargs.mlflow.experiment",
    **{f"sandbox.{k}": f"sandbox.limits.{k}" for k in ("timeout_s", "cpu_s", "memory_mb", "max_processes")},
    "task.split": "task.params.split (with source \"hf\")",
    **{f"task.{k}": f"task.params.{k} (with source \"jsonl\", \"parquet\" or \"hf\")"
       for k in ("prompt_column", "answer_column")},
    "algo.stratum_key": "algo.advantage_kwargs.stratum (with advantage = \"stratified\")",
    **{f"algo.{k}": f"algo.advantage_kwargs.{k} (with advantage = \"gae\")" for k in ("critic_lr", "value_clip")},
}
"""Keys of earlier versions, and where their setting lives now (named in the error)."""


def _parse_value(text: str) -> Any:
    """A command-line value as TOML (numbers, booleans, lists, inline tables), else a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one `dotted.key=value` to a nested dict in place."""
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected key=value, e.g. algo.loss_kwargs.clip_high=0.28")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{override}': '{part}' is not a section")
    node[parts[-1]] = _parse_value(text.strip())


def _format_validation_error(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        got = e.get("input")
        shown = f" (got {got!r})" if not isinstance(got, dict) else ""
        lines.append(f"{where}: {loc}: {e['msg']}{shown}")
    return "\n".join(lines)


def from_dict(data: dict[str, Any], where: str = "config", command: str = "train") -> RunConfig:
    """Validate a nested dict as `command`'s config (train, sft or dpo)."""
    root = ROOTS[command]
    _check_keys(data, root, where, root=root)
    try:
        return root.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, where)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                command: str = "train") -> RunConfig:
    """Read a TOML file (optional), apply `key=value` overrides, and validate as `command`'s config
    (`rlvr train`'s by default; "sft" and "dpo" have their own roots)."""
    if command not in ROOTS:
        raise ConfigError(f"no config for command {command!r} (train, sft, dpo)")
    data: dict[str, Any] = {}
    where = "command line"
    if path is not None:
        p = config_file(path)
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"{p}: invalid TOML: {err}") from None
        where = str(p)
        _beside(data, p.parent)
    for override in overrides:
        apply_override(data, override)
    return from_dict(data, where if not overrides else f"{where} + overrides", command)


PACKAGED = Path(__file__).resolve().parent.parent / "configs"
"""The example configs shipped in the package (rlvr/configs), named by `--config demo`."""


def packaged_configs() -> list[str]:
    return sorted(p.stem for p in PACKAGED.glob("*.toml"))


def config_file(path: str | Path) -> Path:
    """The config file `path` names: a file, or the name of a packaged example (`demo`,
    `demo.toml`), so that `--config demo` works wherever rlvr is installed."""
    p = Path(path)
    if p.is_file():
        return p
    if len(p.parts) == 1 and (PACKAGED / p.with_suffix(".toml").name).is_file():
        return PACKAGED / p.with_suffix(".toml").name
    hint = (f"; the packaged examples are {', '.join(packaged_configs())} (e.g. --config demo)"
            if len(p.parts) == 1 else "")
    raise ConfigError(f"config file not found: {p}{hint}")


PATH_KEYS = (("task", "path"), ("sft", "data"), ("dpo", "data"))
"""Keys naming files: a relative one is read from the working directory, or else (where it is
there and not here) from the config file's folder: a packaged example's data lies beside it."""


def _beside(data: dict[str, Any], folder: Path) -> None:
    for section, key in PATH_KEYS:
        value = data.get(section, {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and not Path(value).is_absolute() and not Path(value).exists() \
                and (folder / value).exists():
            data[section][key] = str((folder / value).resolve())


def to_toml(cfg: RunConfig, notes: tuple[str, ...] = ()) -> str:
    """The run directory's config.toml: every key the config sets or that differs from its default
    (the rest left out, so it reads as what makes this run), under a header naming the rlvr version
    whose defaults fill in the rest, and `notes` (comment lines: what the run composed, once it is
    set up). Loading it gives back an equal config (with that version)."""
    header = (f"# rlvr {__version__}, `rlvr {cfg.command}`: the keys this run sets; every other key has its "
              f"default in this version (`rlvr config {cfg.command}`)\n") + "".join(f"# {note}\n" for note in notes)
    given = _merged(cfg.model_dump(mode="json", exclude_unset=True),
                    cfg.model_dump(mode="json", exclude_defaults=True))
    return header + _dump_table(given, [])


def _merged(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """The keys of both dumps of one config, sections merged key by key."""
    out = dict(a)
    for k, v in b.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else out.get(k, v)
    return out


def written_version(text: str) -> str | None:
    """The rlvr version named in a config.toml's header (None: not written by `to_toml`)."""
    first = text.split("\n", 1)[0]
    return first[len("# rlvr "):].split(",", 1)[0] if first.startswith("# rlvr ") else None


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _toml_key(k: str) -> str:
    return k if k.replace("_", "").replace("-", "").isalnum() else _toml_value(k)


def _dump_table(d: dict[str, Any], path: list[str]) -> str:
    scalars, tables, arrays = [], [], []
    for k, v in d.items():
        if v is None:
            continue  # TOML has no null: an absent key means the default (None)
        if isinstance(v, dict) and k in _SECTIONS:
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and k == "rewards":
            arrays.append((k, v))
        else:
            scalars.append(f"{_toml_key(k)} = {_toml_value(v)}")
    out = "\n".join(scalars) + ("\n" if scalars else "")
    for k, v in arrays:
        for item in v:
            out += f"\n[[{k}]]\n" + _dump_table(item, path + [k])
    for k, v in tables:
        out += f"\n[{'.'.join(path + [k])}]\n" + _dump_table(v, path + [k])
    return out


def _sections() -> set[str]:
    """The config's [tables]: every field of a root that is a section model."""
    return {name for root in ROOTS.values() for name, f in root.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


_SECTIONS = _sections()


def describe(command: str = "train") -> str:
    """Every key `command`'s config reads, with its default and docstring: the text behind `rlvr config`."""
    root = ROOTS[command]
    lines = [f"# `rlvr {command}`'s config keys"]

    tables: list[tuple[str, type[BaseModel]]] = []  # lists of sections ([[rewards]]): their keys come last

    def walk(model: type[BaseModel], prefix: str, only: tuple[str, ...] | None = None, top: bool = True) -> None:
        for name, field in model.model_fields.items():
            if only is not None and name not in only:
                continue
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                read = root.partial.get(name) if not prefix else None
                if read != ():
                    lines.append(f"\n[{prefix}{name}]")
                    walk(sub, prefix + name + ".", read, top)
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, list) and default and isinstance(default[0], BaseModel):
                default = [d.model_dump(exclude_none=True) for d in default]
            shown = "(required)" if field.is_required() else repr(default)
            lines.append(f"{prefix}{name} = {shown}\n    {field.description or ''}")
            item = next((a for a in get_args(sub) if isinstance(a, type) and issubclass(a, BaseModel)), None)
            if item is not None and top:
                tables.append((prefix + name, item))

    walk(root, "")
    for name, item in tables:
        lines.append(f"\n[[{name}]]  # each entry of the list {name}")
        walk(item, "", top=False)
    return "\n".join(lines)


def describe_examples() -> str:
    """The packaged example configs (`--config NAME`), each with its first comment line."""
    lines = ["# the example configs shipped with rlvr (rlvr/configs): rlvr train --config NAME"]
    for name in packaged_configs():
        text = (PACKAGED / f"{name}.toml").read_text().splitlines()
        first = next((line.lstrip("# ").strip() for line in text if line.startswith("#")), "")
        lines.append(f"{name:<16} {first}")
    return "\n".join(lines)


def declared_keys(command: str = "train") -> list[str]:
    """The keys `rlvr config <command>` lists (sections' keys, dotted)."""
    text = describe(command).split("\n[[", 1)[0]  # not the keys of a list's entries ([[rewards]])
    return [line.split(" = ", 1)[0] for line in text.splitlines()
            if " = " in line and not line.startswith((" ", "#", "["))]
