"""Reward functions written for TRL or verl, called the way they expect (`[[rewards]] style`).

rlvr calls a reward as ``fn(prompt, completion, **example)`` (or, with ``group = true``, with the
list of a prompt's completions). Functions written for other trainers keep their own signatures:

- **TRL** (``GRPOTrainer``'s reward functions): ``f(prompts, completions, completion_ids,
  trainer_state, log_extra, log_metric, **dataset_columns) -> list[float | None]``, sync or
  ``async def``. Called once per prompt with its G completions. Every dataset column arrives as
  a list with one entry per completion. Prompts and completions are strings, or, for a dataset
  whose prompt is a list of chat messages, the messages and ``[{"role": "assistant",
  "content": ...}]``. `completion_ids` are the sampled token ids. `trainer_state` is None (there
  is no TRL trainer), and `log_extra`/`log_metric` accept and drop their values. In TRL a None
  means "this function does not apply to this sample" (a multi-task reward). Here it gives that
  sample no value for this reward, which is what a routed reward gives (no key, no
  contribution), not rlvr's None (exclude the sample).
- **verl** (``compute_score``): ``f(data_source, solution_str, ground_truth, extra_info=None)
  -> float | dict``, one completion at a time. ``ground_truth`` is the row's
  ``reward_model.ground_truth`` (verl's parquet layout), else its ``ground_truth``, else its
  answer. A dict gives its ``"score"``; its other keys with a number (or a bool) are logged, as
  verl logs them: each key ``k`` as the part ``<name>/k`` (metric ``rewards/<name>/k``; a key that
  is one of rlvr's flags, error, excluded, masked or no_value, as ``k_``).

Keyword arguments a function does not accept are left out (unless it takes ``**kwargs``), so
`def f(completions, solution, **kwargs)` and `def f(completions, **kwargs)` both work.

``style = "auto"`` (the default) reads the signature: a parameter ``completions``,
``completion_ids`` or ``prompts`` without ``prompt`` or ``completion`` means TRL (rlvr's own group rewards take ``prompt, completions``); ``solution_str`` with ``ground_truth`` means verl; anything else is
rlvr's own convention, as before.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

STYLES = ("auto", "rlvr", "trl", "verl")

NO_VALUE = object()
"""What a reward returns for "no value for this sample" (TRL's None): no key, no contribution."""

PROMPT_MESSAGES = "prompt_messages"
"""The example field holding a prompt given as chat messages (TRL's conversational layout, verl's
parquet): TRL rewards receive the messages, as TRL would pass them."""


def detect_style(fn: Callable[..., Any]) -> str:
    """"trl", "verl" or "rlvr", from the parameter names (see module docstring)."""
    try:
        names = set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: rlvr's own
        return "rlvr"
    # TRL's own names (rlvr's group rewards take prompt and completions, its others prompt and completion)
    if {"completions", "completion_ids", "prompts"} & names and not {"prompt", "completion"} & names:
        return "trl"
    if {"solution_str", "ground_truth"} <= names:
        return "verl"
    return "rlvr"


def _accepted(fn: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes (all of them if it has **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


def _value(result: Any) -> Any:
    return asyncio.run(result) if inspect.iscoroutine(result) else result


def _drop(*_: Any, **__: Any) -> None:
    """log_extra / log_metric: TRL's loggers, whose values rlvr does not keep."""


def trl_style(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A group reward (prompt, completions, **example) calling a TRL reward function."""
    def call(prompt: str, completions: Sequence[str], *, completion_ids: Sequence[Sequence[int]] | None = None,
             **fields: Any) -> Any:
        n = len(completions)
        messages = fields.pop(PROMPT_MESSAGES, None)
        if messages is not None:
            prompts: list[Any] = [messages] * n
            texts: list[Any] = [[{"role": "assistant", "content": c}] for c in completions]
        else:
            prompts, texts = [prompt] * n, list(completions)
        columns = {k: [v] * n for k, v in fields.items()}
        ids = [list(x) for x in completion_ids] if completion_ids is not None else None
        kwargs = _accepted(fn, {"prompts": prompts, "completions": texts, "completion_ids": ids, "trainer_state": None,
                                "log_extra": _drop, "log_metric": _drop, **columns})
        values = _value(fn(**kwargs))
        if isinstance(values, list | tuple):
            return [NO_VALUE if v is None else v for v in values]
        return values  # the caller reports a result that is not one value per completion

    call.__name__ = getattr(fn, "__name__", "trl_reward")
    call.wants_completion_ids = True  # type: ignore[attr-defined]
    return call


def ground_truth(fields: dict[str, Any]) -> Any:
    """verl's ground truth: ``reward_model.ground_truth``, else ``ground_truth``, else the answer."""
    model = fields.get("reward_model")
    if isinstance(model, dict) and "ground_truth" in model:
        return model["ground_truth"]
    return fields.get("ground_truth", fields.get("answer"))


VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""What verl passes a `compute_score` for each response."""


def verl_style(fn: Callable[..., Any], reward_kwargs: dict[str, Any] | None = None) -> Callable[..., Any]:
    """A per-completion reward (prompt, completion, **example) calling a verl compute_score.
    ``reward_kwargs``: verl's `custom_reward_function.reward_kwargs`, passed on every call beside
    its arguments, as verl does; each must be a parameter of `fn` (or `fn` has **kwargs), and
    none may be one of verl's own (`VERL_ARGUMENTS`): a ValueError now, where verl would raise a
    TypeError at the first response."""
    extra = dict(reward_kwargs or {})
    clash = sorted(set(extra) & set(VERL_ARGUMENTS))
    if clash:
        raise ValueError(f"reward_kwargs {clash} would replace what verl passes itself ({', '.join(VERL_ARGUMENTS)})")
    unknown = sorted(set(extra) - set(_accepted(fn, extra)))
    if unknown:
        raise ValueError(f"reward_kwargs {unknown} are not parameters of {getattr(fn, '__name__', fn)!r}, "
                         "which takes no **kwargs")

    def call(prompt: str, completion: str, **fields: Any) -> Any:
        kwargs = _accepted(fn, {"data_source": fields.get("data_source"), "solution_str": completion,
                                "ground_truth": ground_truth(fields), "extra_info": fields.get("extra_info")})
        value = _value(fn(**kwargs, **extra))
        if isinstance(value, dict):
            if "score" not in value:
                raise TypeError(f"a verl reward's dict needs a 'score' (got keys {sorted(value)})")
            return with_info(value["score"], {k: v for k, v in value.items() if k != "score"})
        return value

    call.__name__ = getattr(fn, "__name__", "compute_score")
    return call


FLAGS = ("error", "excluded", "masked", "no_value")
"""The suffixes of rlvr's own reward-part flags (rlvr.rewards.combine): an info key named so is renamed."""


class WithInfo(float):
    """A reward's value with named numbers beside it (a verl dict's other keys), for the metrics."""

    info: dict[str, float]


def with_info(score: Any, info: dict[str, Any]) -> Any:
    """`score` carrying `info`'s finite numbers (bools as 0/1; other values dropped), where it is a
    number; anything else as it is (None excludes; a non-number fails when it is checked)."""
    score = scalar(score)
    if not isinstance(score, numbers.Real):
        return score
    kept = {}
    for key, v in info.items():
        v = scalar(v)
        if isinstance(v, numbers.Real) and math.isfinite(float(v)):
            kept[f"{key}_" if str(key) in FLAGS else str(key)] = float(v)
    out = WithInfo(score)
    out.info = kept
    return out


def scalar(value: Any) -> Any:
    """A 0-d numpy or torch number as a Python float (verl's `compute_score` may return
    ``torch.tensor(1.)``); anything else as it is."""
    if type(value).__module__ in ("numpy", "torch") and getattr(value, "ndim", None) == 0 \
            and "complex" not in str(getattr(value, "dtype", "complex")):
        return float(value)
    return value
