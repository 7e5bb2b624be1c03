"""Environments from the `verifiers` package, trained unchanged (`env.name = "verifiers"`).

    [env]
    name = "verifiers"
    kwargs = {load = "my_env:load_environment", args = {difficulty = "easy"}}

`load` names a function returning a verifiers environment (a ``SingleTurnEnv``, ``MultiTurnEnv``
or ``ToolEnv`` with its ``Rubric``, from verifiers' classic API; `verifiers==0.3.1` is the
version supported, the `verifiers` extra). The environment brings its own dataset, which
becomes the run's prompts (``task.source = "env"``, the default with this env). Each episode is
one `env.run_rollout` of a dataset row, its model calls going through rlvr's OpenAI-compatible
server (rlvr.agents.openai_agent: the trajectory is the calls' exact token ids, and the run's
sampling settings and env limits hold). The rubric's reward is the episode's reward. A rollout
that verifiers reports as failed because of what the policy did (`POLICY_ERRORS`: an empty
reply, an unreadable tool call, a context it filled) or because a call hit the episode's limits
gets reward 0 and stays in the update; any other failure is an episode without a verdict
(counted in env/error, excluded).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

from rlvr.agents import verifiers_v1
from rlvr.agents.contract import as_agent
from rlvr.agents.openai_agent import episodes_of
from rlvr.data.tasks import Example
from rlvr.rewards.styles import PROMPT_MESSAGES
from rlvr.options import check_names
from rlvr.types import SamplingParams
from rlvr.rewards.combine import load_callable

POLICY_ERRORS = frozenset({"InvalidModelResponseError", "EmptyModelResponseError", "OverlongPromptError",
                           "ToolParseError", "ToolCallError"})
"""Errors verifiers reports that the policy caused (what it wrote, or a context it filled): reward 0,
kept in the update, so that the policy learns to avoid them. Any other (the infrastructure, a bug
in the environment) leaves the episode without a verdict."""

SUPPORTED = "0.3.1"
"""The verifiers version this adapter is written and tested against."""


def _options(kwargs: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(load, args, the rest) of env.kwargs for a classic environment."""
    check_names("env.kwargs for verifiers", kwargs, ["load", "args", "timeout", "v1"])
    if "v1" in kwargs:
        raise ValueError("env.kwargs for verifiers takes either load (a classic environment) or v1 (a v1 [env] "
                         "block), not both")
    rest = dict(kwargs)
    load, args = rest.pop("load", None), rest.pop("args", {})
    if not isinstance(load, str):
        raise ValueError('env.name = "verifiers" needs env.kwargs.load = "package.module:load_environment"')
    if not isinstance(args, dict):
        raise ValueError(f"env.kwargs.args must be a table of load_environment's arguments, got {args!r}")
    return load, args, rest


def _v1(kwargs: dict[str, Any]) -> Any:
    check_names("env.kwargs for verifiers v1", dict(kwargs), ["v1", "timeout"])
    return verifiers_v1.of(kwargs["v1"])


def load_environment(load: str, args: dict[str, Any]) -> Any:
    """The environment `load(**args)` returns (loaded once per process for the same arguments)."""
    return _load(load, json.dumps(args, sort_keys=True, default=str))


@functools.cache
def _load(load: str, args_json: str) -> Any:
    try:
        import verifiers
    except ImportError:
        raise ImportError(f"env.name = \"verifiers\" needs the verifiers package: pip install 'rlvr[verifiers]' "
                          f"(verifiers=={SUPPORTED})") from None

    if not hasattr(verifiers, "Environment"):  # 0.4 keeps only its v1 stack
        raise ImportError(f"env.kwargs.load names a classic verifiers environment, which verifiers "
                          f"{getattr(verifiers, '__version__', '?')} no longer has: pin verifiers=={SUPPORTED}, "
                          "or train a v1 Taskset with env.kwargs.v1 (docs/interop.md)")
    env = load_callable(load)(**json.loads(args_json))
    if not isinstance(env, verifiers.Environment):
        raise ValueError(f"env.kwargs.load = {load!r} returned {type(env).__name__}, not a verifiers Environment")
    return env


def environment_examples(env_kwargs: dict[str, Any]) -> list[Example]:
    """The environment's dataset as examples: its prompt messages (rendered whole, as the
    environment formats them), its answer, and every other column for the rollout."""
    if "v1" in env_kwargs:
        return _v1(env_kwargs).examples()
    load, args, _ = _options(env_kwargs)
    dataset = load_environment(load, args).get_dataset()
    examples = []
    for k, row in enumerate(dataset):
        row = dict(row)
        messages = row.get("prompt")
        if not isinstance(messages, list) or not any(m.get("role") == "user" for m in messages):
            raise ValueError(f"{load}: dataset row {k} has no prompt messages with a user turn (got {messages!r:.200})")
        text = next(m["content"] for m in reversed(messages) if m.get("role") == "user")
        answer = row.get("answer")
        examples.append(Example(prompt=str(text), answer=None if answer is None else str(answer),
                                fields={**row, PROMPT_MESSAGES: messages},
                                id=f"verifiers/{row.get('example_id', k)}"))
    if not examples:
        raise ValueError(f"{load}: the environment's dataset is empty")
    return examples


def verifiers_episodes(env: Any, tokenizer: Any, rewards: list[Any], params: SamplingParams, *,
                       system_prompt: str | None = None) -> Callable[..., list[Any]]:
    """The episode builder for `env.name = "verifiers"` (rlvr.train.data.Episodes)."""
    if "v1" in env.kwargs:
        return episodes_of(as_agent(_v1(env.kwargs).episode, "verifiers v1", {}), env,
                           dict(env.kwargs).get("timeout", 300.0), tokenizer, rewards, params,
                           system_prompt=system_prompt)
    load, args, rest = _options(dict(env.kwargs))
    environment = load_environment(load, args)

    async def run_episode(client: Any, row: dict[str, Any]) -> float:
        from verifiers.legacy.clients import OpenAIChatCompletionsClient

        rollout = {"prompt": row[PROMPT_MESSAGES], "example_id": row.get("example_id", 0),
                   **{k: row[k] for k in ("answer", "task", "info") if row.get(k) is not None}}
        out = await environment.run_rollout(rollout, OpenAIChatCompletionsClient(client), "policy", {})
        error = out.get("error")
        if error and (error.get("error") if isinstance(error, dict) else None) in POLICY_ERRORS:
            return 0.0  # the policy's own failure (an empty reply, an unreadable tool call): trained as a 0
        if error:
            raise RuntimeError(f"the verifiers rollout failed: {error}")
        return float(out["reward"])

    timeout = rest.pop("timeout", 300.0)
    return episodes_of(as_agent(run_episode, load, {}), env, timeout, tokenizer, rewards, params,
                       system_prompt=system_prompt)
