"""Resolve reward specs from the config and combine their scores into one scalar reward.

A config names each reward by a built-in name ("math_verify") or a dotted import path
("mypkg.rewards:score"), with a weight and keyword arguments. The total reward of a completion
is ``sum_i weight_i * fn_i(prompt, completion, **example, **kwargs_i)``.

- A function may be ``async def``; it is run to completion on its own event loop.
- A function may return None: "no verdict" for this completion. The sample is then excluded
  from the update (flagged ``<name>/excluded``; see ``Sample.excluded``) and counted.
- A function that raises, returns a non-number or a non-finite number, or runs past its
  ``timeout_s`` (user functions, 60 s by default, run in a worker thread for that; built-ins
  bound their own time) is a failure. With ``on_error = "zero"`` (the default) it scores 0.0
  for that completion, is counted as ``<name>/error`` and logged once per (reward, kind of
  failure); with ``"stop"`` the run stops with a ``RewardError`` that carries the traceback
  and the completion. A timed-out call keeps running in its thread: the run goes on, and a
  reward that can hang for good should run its work in a process it can kill (the sandbox does).
- A failure that is not the completion's, an ``InfrastructureError`` (rlvr.errors: the sandbox
  could not run the program, a judge service is down), raised or returned in a group reward's
  list in that completion's place, is never a score; nor is a ``ConnectionError``, a
  ``TimeoutError`` or urllib's ``URLError`` that the function raises (a service it calls did not
  answer; `_UNREACHABLE`): it is counted as ``<name>/error`` and the
  sample is excluded (``<name>/excluded``), or with ``"stop"`` the run stops. Its reason is
  logged once per reward.
"""

from __future__ import annotations

import asyncio
import dataclasses
import difflib
import importlib
import inspect
import logging
import math
import numbers
import threading
import traceback
import urllib.error
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from typing import Any

from rlvr.algos.registry import check_keywords
from rlvr.errors import InfrastructureError, MissingExtra
from rlvr.rewards.builtin import GROUP_REWARDS, MANY, REWARDS
from rlvr.rewards.extract import EXTRACTORS
from rlvr.rewards.intrinsic import INTRINSIC, information_gain
from rlvr.options import RLPOptions, options
from rlvr.rewards.styles import NO_VALUE, STYLES, WithInfo, detect_style, trl_style, verl_style
from rlvr.rewards.styles import scalar as _scalar
from rlvr.sandbox import SandboxUnavailable

logger = logging.getLogger("rlvr.rewards")

_SPEC_KEYS = {"fn", "weight", "name", "kwargs", "timeout_s", "group", "sources", "source_field", "style"}
USER_TIMEOUT_S = 60.0
_WARNED: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class RewardFn:
    """One resolved reward: its callable, weight in the total, and extra keyword arguments."""

    name: str
    fn: Callable[..., Any]
    weight: float
    kwargs: dict[str, Any]
    timeout_s: float | None = None
    """Wall-clock limit of one call, enforced from a worker thread; None = none (built-ins)."""
    group: bool = False
    """Called once per prompt with the list of its completions, returning one value each
    (e.g. majority vote); otherwise once per completion."""
    intrinsic: bool = False
    """Computed from the policy's own distributions after sampling (rlvr.rewards.intrinsic), not
    by score(): the loop fills it in."""
    sources: tuple[str, ...] = ()
    """Per-source routing: only examples whose ``source_field`` is one of these are scored by it
    (the others get no value for it, not a zero); empty = all."""
    source_field: str = "task"
    wants_completion_ids: bool = False
    """Called with ``completion_ids=`` (the sampled token ids), as TRL's reward functions are."""
    many: Callable[..., Any] | None = None
    """A group reward's way to score many groups in one call (`score_groups`): ``many(prompts,
    completions, **kwargs)``, with each prompt's list of completions, returns every completion's
    value, flat, in order (`reward_model`'s fills its batches with a whole step). It reads the
    reward's kwargs, not the rows' fields."""
    on_error: str = "zero"
    """What a failure does where the caller of score_group does not say: "zero" scores it 0.0
    and counts it, "stop" raises RewardError (the run's on_reward_error, which so reaches every
    caller: an environment's or an agent's scoring too)."""

    def applies(self, example: dict[str, Any]) -> bool:
        return not self.sources or str(example.get(self.source_field, "default")) in self.sources


class RewardError(ValueError):
    """A reward failed and the config says to stop (on_error = "stop")."""


def _split_path(spec: str) -> tuple[str, str]:
    """'pkg.mod:fn' or 'pkg.mod.fn' → ('pkg.mod', 'fn'). The part after ':' may be dotted."""
    if ":" in spec:
        module, _, attr = spec.partition(":")
    else:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ValueError(f"reward {spec!r}: expected 'package.module:function'")
    return module, attr


def load_callable(spec: str) -> Callable[..., Any]:
    """The reward named by ``spec``: a key of REWARDS or a dotted path to a callable."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec and "." not in spec:
        nearest = difflib.get_close_matches(spec, REWARDS, n=1)
        hint = f" Did you mean {nearest[0]!r}?" if nearest else ""
        raise ValueError(
            f"unknown reward {spec!r}.{hint} Built-in rewards: {', '.join([*REWARDS, *INTRINSIC])}; "
            "a user reward is a dotted path such as 'mypkg.rewards:score'"
        )
    obj = load_object(spec, "reward")
    if not callable(obj):
        raise ValueError(f"reward {spec!r}: {_split_path(spec)[1]!r} is a {type(obj).__name__}, not callable")
    return obj


def load_object(spec: str, what: str) -> Any:
    """The object a dotted path such as 'mypkg.module:name' names; errors say it was the `what`."""
    module_name, attr_path = _split_path(spec)
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {spec!r}: cannot import module {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            public = [n for n in dir(obj) if not n.startswith("_")]
            nearest = difflib.get_close_matches(attr, public, n=1)
            hint = f"; did you mean {nearest[0]!r}?" if nearest else ""
            raise ValueError(f"{what} {spec!r}: {obj.__name__!r} has no attribute {attr!r}{hint}")
        obj = getattr(obj, attr)
    return obj


def _check_on_error(on_error: str) -> None:
    if on_error not in ("zero", "stop"):
        raise ValueError(f"on_error must be 'zero' or 'stop', got {on_error!r}")


def build_rewards(specs: list[dict[str, Any]], on_error: str = "zero") -> list[RewardFn]:
    """Resolve config specs ``{"fn", "weight"=1.0, "name"=<last part of fn>, "kwargs"={}}``, each
    failing as ``on_error`` says (`RewardFn.on_error`)."""
    _check_on_error(on_error)
    rewards: list[RewardFn] = []
    for i, spec in enumerate(specs):
        unknown = set(spec) - _SPEC_KEYS
        if unknown or "fn" not in spec:
            raise ValueError(
                f"reward spec #{i} {spec!r}: needs 'fn' and may have only {sorted(_SPEC_KEYS)}"
            )
        fn_spec = str(spec["fn"])
        name = spec.get("name") or fn_spec.replace(":", ".").rsplit(".", 1)[-1]
        weight = float(spec.get("weight", 1.0))
        if not math.isfinite(weight):
            raise ValueError(f"reward {name!r}: weight must be finite, got {weight}")
        if any(r.name == name for r in rewards):
            raise ValueError(f"two rewards are named {name!r}; give one a distinct 'name'")
        kwargs = dict(spec.get("kwargs", {}))
        routing: dict[str, Any] = {"sources": tuple(str(x) for x in spec.get("sources") or ()),
                                   "source_field": str(spec.get("source_field") or "task")}
        if fn_spec == "information_gain":  # RLP: computed from the policy and its EMA (rlvr.train.methods.rlp)
            options(f"reward {name!r}: information_gain's kwargs", RLPOptions, kwargs)  # read by the RLP method
            rewards.append(RewardFn(name, information_gain, weight, {}, intrinsic=True, **routing))
            continue
        if fn_spec in INTRINSIC:
            if kwargs:
                raise ValueError(f"reward {name!r}: {fn_spec} takes no kwargs")
            rewards.append(RewardFn(name, INTRINSIC[fn_spec], weight, {}, intrinsic=True, **routing))
            continue
        fn = load_callable(fn_spec)
        style = str(spec.get("style") or "auto")
        if style not in STYLES:
            raise ValueError(f"reward {name!r}: style must be one of {', '.join(STYLES)}, got {style!r}")
        if style == "auto":
            style = "rlvr" if fn in REWARDS.values() else detect_style(fn)
        if style == "trl":
            if kwargs:
                raise ValueError(f"reward {name!r}: a TRL-style reward takes its inputs from the dataset's columns, "
                                 "not kwargs")
            fn, spec = trl_style(fn), {**spec, "group": True}
        elif style == "verl":  # kwargs: verl's reward_kwargs, bound here
            if spec.get("group"):
                raise ValueError(f"reward {name!r}: a verl-style reward scores one response at a time "
                                 "(verl's compute_score); drop group = true")
            try:
                fn, kwargs = verl_style(fn, kwargs), {}
            except ValueError as e:
                raise ValueError(f"reward {name!r}: {e}") from None
        _check_kwargs(name, fn, kwargs)
        timeout = spec.get("timeout_s")
        if timeout is None and fn not in REWARDS.values():
            timeout = USER_TIMEOUT_S
        if timeout is not None and not timeout > 0:
            raise ValueError(f"reward {name!r}: timeout_s must be > 0, got {timeout}")
        group = bool(spec.get("group", False)) or fn in GROUP_REWARDS.values()
        rewards.append(RewardFn(name, fn, weight, kwargs, None if timeout is None else float(timeout), group,
                                wants_completion_ids=getattr(fn, "wants_completion_ids", False), many=MANY.get(fn),
                                **routing))
    return [dataclasses.replace(r, on_error=on_error) for r in rewards]


def _check_kwargs(name: str, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    """A misspelt keyword or answer format is an error now, not a silent zero reward later."""
    if "extract" in kwargs and kwargs["extract"] not in EXTRACTORS:
        raise ValueError(f"reward {name!r}: extract={kwargs['extract']!r} is not an answer format; "
                         f"use one of {', '.join(EXTRACTORS)}")
    if fn not in REWARDS.values():
        return  # a user's function may take anything through **example
    check_keywords(f"reward {name!r}", fn, kwargs)


def _warn_once(name: str, kind: str, message: str) -> None:
    if (name, kind) not in _WARNED:
        _WARNED.add((name, kind))
        consequence = "excluding the sample" if kind == _INFRA else "scoring it 0.0"
        logger.warning(
            "reward %r failed (%s); %s. Further %s failures of this reward are "
            "not logged (a training run counts them in its metric 'rewards/%s/error').\n%s",
            name, kind, consequence, kind, name, message,
        )


_EXCLUDED = "excluded"
_NO_VALUE = "no value"  # a TRL-style None: this reward does not apply to this sample
_UNAVAILABLE = "unavailable"  # an InfrastructureError: no verdict, not the completion's fault
_INFRA = "infrastructure"
MAX_STUCK = 8
"""A reward with this many calls still running past its timeout_s hangs, and more would only pile
up threads (a thread cannot be killed): the run stops, naming it (`_invoke`)."""
_STUCK: dict[str, list[threading.Thread]] = {}
"""Per reward, its calls that ran past timeout_s, in threads that may still run."""


def _run(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a reward; an async one (``async def``) is run to completion on its own event loop, and a
    generator's values are listed, here, where the call's time limit and error handling apply."""
    value = fn(*args, **kwargs)
    if inspect.iscoroutine(value):
        value = asyncio.run(value)
    return list(value) if inspect.isgenerator(value) else value


def _invoke(reward: RewardFn, prompt: Any, completion: Any, fields: dict[str, Any],
            fn: Callable[..., Any] | None = None) -> Any:
    """The reward's value (its function's, or ``fn``'s: `RewardFn.many`); with a timeout_s, called on a thread of its own (a daemon: one that
    never returns neither keeps the process alive at exit nor holds up any other call, as a shared
    pool's full queue did), TooSlow past it. A reward with `MAX_STUCK` calls still running past
    their limit stops the run (RewardError)."""
    args, fn = {**fields, **reward.kwargs}, fn or reward.fn
    if reward.timeout_s is None:
        return _run(fn, prompt, completion, **args)
    stuck = _STUCK.setdefault(reward.name, [])
    stuck[:] = [t for t in stuck if t.is_alive()]
    if len(stuck) >= MAX_STUCK:
        raise RewardError(f"reward {reward.name!r} has {len(stuck)} calls still running past its timeout_s "
                          f"({reward.timeout_s:g} s): it hangs, and a thread cannot be stopped. Make it return (or "
                          "time out by itself, e.g. on its network calls), or give it a process of its own")
    result: Future[Any] = Future()

    def call() -> None:
        try:
            result.set_result(_run(fn, prompt, completion, **args))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            result.set_exception(exc)

    thread = threading.Thread(target=call, name=f"rlvr-reward-{reward.name}", daemon=True)
    thread.start()
    try:
        return result.result(timeout=reward.timeout_s)
    except FuturesTimeout:
        stuck.append(thread)
        raise TooSlow(f"no result after {reward.timeout_s:g} s (timeout_s)") from None


class TooSlow(Exception):
    """A reward ran past its ``timeout_s``: a failure scored like any other (the completion made it
    slow, as far as rlvr can tell), unlike a TimeoutError the function raises itself (`_UNREACHABLE`)."""


_UNREACHABLE = (ConnectionError, TimeoutError, urllib.error.URLError)
"""Exceptions that say a service a reward calls did not answer (refused, reset, timed out,
unresolvable): not the completion's fault, so treated as an InfrastructureError, never a 0 trained
on (a review, session 19, found a judge that was down scored 0 and trained as a bad answer)."""


def _as_infrastructure(exc: BaseException) -> InfrastructureError | None:
    return InfrastructureError(f"{type(exc).__name__}: {exc}") if isinstance(exc, _UNREACHABLE) else None


def _call(reward: RewardFn, prompt: str, completions: list[str], example: dict[str, Any],
          on_error: str, completion_ids: list[Any] | None = None) -> list[float | str | None]:
    """Each completion's value as a finite float, _EXCLUDED where the reward returned None, or
    None (after a warning) where it failed; with on_error = "stop", a failure raises RewardError.
    A group reward is called once with all the completions; any other once per completion."""
    # a data row's own "prompt" column (JSONL's default) is the prompt already passed
    fields = {k: v for k, v in example.items() if k not in ("prompt", "completion")}
    if reward.wants_completion_ids:
        fields["completion_ids"] = completion_ids
    if not reward.group:
        return [_one(reward, prompt, c, fields, on_error) for c in completions]
    return _group_values(reward, completions, on_error, lambda: _invoke(reward, prompt, completions, fields))


def _group_values(reward: RewardFn, completions: list[str], on_error: str,
                  call: Callable[[], Any]) -> list[float | str | None]:
    """What ``call`` (one call of a group reward for all of ``completions``) gave each, checked as
    `_call` says; a failure of the call is every completion's."""
    try:
        values = call()
    except (SandboxUnavailable, RewardError, MissingExtra):
        raise
    except InfrastructureError as exc:
        return [_unavailable(reward, exc, completions[0], on_error)] * len(completions)
    except Exception as exc:
        unreachable = _as_infrastructure(exc)
        if unreachable is not None:
            return [_unavailable(reward, unreachable, completions[0], on_error)] * len(completions)
        _failed(reward, type(exc).__name__, "".join(traceback.format_exception(exc, limit=-3)), completions[0], on_error)
        return [None] * len(completions)
    values = _listed(values)
    if not isinstance(values, (list, tuple)) or len(values) != len(completions):
        _failed(reward, "wrong length", f"a group reward must return one value per completion ({len(completions)}); "
                f"got {values!r:.200}", completions[0], on_error)
        return [None] * len(completions)
    return [_checked_value(reward, v, c, on_error) for v, c in zip(values, completions)]


def _one(reward: RewardFn, prompt: str, completion: str, fields: dict[str, Any], on_error: str) -> float | str | None:
    try:
        value = _invoke(reward, prompt, completion, fields)
    except (SandboxUnavailable, RewardError, MissingExtra):
        raise  # not this completion's fault: no code reward can work (or this one hangs), so stop and say so
    except InfrastructureError as exc:
        return _unavailable(reward, exc, completion, on_error)
    except Exception as exc:  # a user reward must not stop training unless asked; see module docstring
        unreachable = _as_infrastructure(exc)
        if unreachable is not None:
            return _unavailable(reward, unreachable, completion, on_error)
        summary = "".join(traceback.format_exception(exc, limit=-3))
        _failed(reward, type(exc).__name__, summary, completion, on_error)
        return None
    return _checked_value(reward, value, completion, on_error)


def _listed(values: Any) -> Any:
    """A group reward's values as a list where it returned an array or tensor of one dimension
    (numpy's, torch's: what TRL accepts; a generator was listed by `_run`); anything else as it is."""
    if type(values).__module__ in ("numpy", "torch") and getattr(values, "ndim", None) == 1:
        return list(values)
    return values


def _checked_value(reward: RewardFn, value: Any, completion: str, on_error: str) -> float | str | None:
    checked = _checked_number(reward, value, completion, on_error)
    info = getattr(value, "info", None)
    if info and isinstance(checked, float):  # a verl dict's other keys, for the metrics
        checked = WithInfo(checked)
        checked.info = info
    return checked


def _checked_number(reward: RewardFn, value: Any, completion: str, on_error: str) -> float | str | None:
    value = _scalar(value)
    if value is NO_VALUE:
        return _NO_VALUE
    if value is None:
        return _EXCLUDED
    if isinstance(value, InfrastructureError):
        return _unavailable(reward, value, completion, on_error)
    if not isinstance(value, numbers.Real):  # bool is a Real: True → 1.0
        _failed(reward, "non-number", f"returned {type(value).__name__}: {value!r:.200}", completion, on_error)
        return None
    try:
        value = float(value)
    except OverflowError:  # an int beyond a float's range (10**400)
        value = math.inf
    if not math.isfinite(value) or not math.isfinite(reward.weight * value):  # 1e308 × a weight of 10 too
        weighted = f" (× weight {reward.weight:g} is beyond a float)" if math.isfinite(value) else ""
        _failed(reward, "non-finite", f"returned {value!r}{weighted}", completion, on_error)
        return None
    return value


def _unavailable(reward: RewardFn, exc: InfrastructureError, completion: str, on_error: str) -> str:
    _failed(reward, _INFRA, f"{type(exc).__name__}: {exc}", completion, on_error)
    return _UNAVAILABLE


def _failed(reward: RewardFn, kind: str, message: str, completion: str, on_error: str) -> None:
    if on_error == "stop":
        raise RewardError(f"reward {reward.name!r} failed ({kind}) on this completion, and failures stop the run "
                          "(on_reward_error = \"stop\"; on_error in score_group):\n"
                          f"{completion[:2000]!r}\n{message}")
    _warn_once(reward.name, kind, message)
    return None


def score(
    rewards: list[RewardFn], prompt: str, completion: str, example: dict[str, Any], on_error: str | None = None
) -> tuple[float, dict[str, float]]:
    """The weighted total reward and each reward's raw value, keyed by name (see score_group)."""
    return score_group(rewards, prompt, [completion], example, on_error)[0]


def score_group(
    rewards: list[RewardFn], prompt: str, completions: list[str], example: dict[str, Any], on_error: str | None = None,
    completion_ids: list[Any] | None = None, scored: Mapping[str, list[float | str | None]] | None = None,
) -> list[tuple[float, dict[str, float]]]:
    """For each completion of one prompt: the weighted total reward and each reward's raw value.

    A reward that fails contributes 0.0, and the dict gains ``f"{name}/error": 1.0``; one that
    returns None contributes 0.0 and the dict gains ``f"{name}/excluded": 1.0`` (each key is
    absent otherwise); an InfrastructureError gains both. A reward routed to other sources has no
    key at all; a TRL-style reward that returned None for a completion (rlvr.rewards.styles) has
    only ``f"{name}/no_value": 1.0``: no contribution, and no verdict (if it is the correctness
    reward, the sample counts in no accuracy).
    ``completion_ids`` (each completion's token ids) reach the rewards that ask for them (TRL's).
    ``on_error = "stop"`` raises RewardError on a failure instead; unset, each reward's own
    (`RewardFn.on_error`, the run's on_reward_error). ``scored``: the checked values of rewards
    already called (`score_groups`), by name.
    """
    if on_error is not None:
        _check_on_error(on_error)
    scored = scored or {}
    # intrinsic rewards are filled in later, from the policy; routed ones only score their sources
    rewards = [r for r in rewards if not r.intrinsic and r.applies(example)]
    per_reward = [scored[reward.name] if reward.name in scored else
                  _call(reward, prompt, completions, example, on_error or reward.on_error, completion_ids)
                  for reward in rewards]
    out = []
    for k in range(len(completions)):
        total = 0.0
        values: dict[str, float] = {}
        for reward, results in zip(rewards, per_reward):
            value = results[k]
            if value == _NO_VALUE:  # no contribution, as a reward routed elsewhere; and no verdict
                values[f"{reward.name}/no_value"] = 1.0
                continue
            if value == _UNAVAILABLE:
                values.update({reward.name: 0.0, f"{reward.name}/error": 1.0, f"{reward.name}/excluded": 1.0})
                continue
            if value is None or value == _EXCLUDED:
                values[reward.name] = 0.0
                values[f"{reward.name}/{'error' if value is None else 'excluded'}"] = 1.0
                continue
            assert isinstance(value, float)
            values[reward.name] = float(value)
            values.update({f"{reward.name}/{k}": v for k, v in getattr(value, "info", {}).items()})
            total += reward.weight * value
        out.append((total, values))
    return out


@dataclass(frozen=True)
class ToScore:
    """One prompt's completions, for `score_groups`: as `score_group`'s arguments."""

    prompt: str
    completions: list[str]
    example: dict[str, Any]
    completion_ids: list[Any] | None = None


def score_groups(rewards: list[RewardFn], groups: Sequence[ToScore],
                 on_error: str | None = None) -> list[list[tuple[float, dict[str, float]]]]:
    """`score_group` of each group, with every reward that can score many groups in one call
    (`RewardFn.many`) called once for all the groups it applies to: a reward model's batches then
    hold a whole step, not one prompt's completions. What such a call returns is checked, and a
    failure counted, as a group reward's (a failed call is every one of its completions')."""
    if on_error is not None:
        _check_on_error(on_error)
    scored: list[dict[str, list[float | str | None]]] = [{} for _ in groups]
    for reward in rewards:
        rows = [i for i, g in enumerate(groups) if reward.applies(g.example)]
        if reward.many is None or reward.intrinsic or not rows:
            continue
        many = reward.many
        prompts, lists = [groups[i].prompt for i in rows], [groups[i].completions for i in rows]
        flat = [c for group in lists for c in group]
        values = _group_values(reward, flat, on_error or reward.on_error,
                               lambda: _invoke(reward, prompts, lists, {}, fn=many))
        for i, group in zip(rows, lists):
            scored[i][reward.name], values = values[:len(group)], values[len(group):]
    return [score_group(rewards, g.prompt, g.completions, g.example, on_error, g.completion_ids, scored=done)
            for g, done in zip(groups, scored)]
