"""OpenEnv environments (`env.name = "openenv"`): an environment served by OpenEnv's server
(`openenv` / `openenv-core` on PyPI, the servers TRL, SkyRL, Unsloth and ART consume) trains
through rlvr's own turn-by-turn runner, token-faithful as every other environment (rlvr.agents.runner).

    [env]
    name = "openenv"
    kwargs = {url = "http://127.0.0.1:8000", action_field = "message"}

The protocol is OpenEnv's WebSocket route ``/ws``, as its own client speaks it: one environment
per connection, so one connection per episode.

    >> {"type": "reset", "data": {"seed": <the example's seed>, **reset_args}}
    << {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
    >> {"type": "step", "data": {<action_field>: <the policy's text>, **action_args}}
    << the same, or {"type": "error", "data": {"message": ..., "code": ...}}
    >> {"type": "close"}

``transport = "http"`` uses ``POST /reset`` and ``POST /step {"action": {...}}`` instead. OpenEnv's
HTTP routes make a new environment for every request, so they serve only environments whose step
needs nothing from the reset (one-step tasks); a multi-turn environment needs the WebSocket.

What the policy sees: each observation as text, from ``observation_template`` (a format string over
the observation's fields, e.g. "{feedback} ({attempts_left} left)"), else the first non-empty
string among its fields prompt, text, message, feedback, content and observation, else its JSON.
The episode's return is the sum of the steps' rewards (``reward = "sum"``) or, for an environment
whose reward is already cumulative, the last one (``"last"``).

Prompts: with ``task.source = "env"`` (the default for this environment) the run makes task.size +
task.eval_size examples, each a reset seed; the G episodes of a prompt share its seed, so they face
the same task. With another source (a JSONL of tasks, say), each example's fields named in
``reset_fields`` are sent with the reset, as TRL passes dataset columns to ``reset``, and its
``seed`` if it has one. ``step_fields`` are sent with every step (``"seed"`` for an environment on
stateless HTTP, whose step must learn the task from the action), beside ``action_args``.

Failures are the environment's, never the policy's. A connection that cannot be made or is lost,
an error frame, an HTTP error, an answer that is not OpenEnv's, or no answer within ``timeout``
seconds ends the episode ``"infra"``: counted in env/error, excluded from the update, each kind
logged once (rlvr.agents.runner). Every episode holds a session on the server, so the server must
allow prompts_per_step × group_size of them at once (OpenEnv's ``max_concurrent_envs``); a session
refused for capacity says so. A server that cannot be reached when the run starts stops it before
the model loads (`check`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlvr.agents.env import StepResult, timeout_seconds
from rlvr.data import Example
from rlvr.errors import InfrastructureError
from rlvr.options import check_names

OBSERVATION_FIELDS = ("prompt", "text", "message", "feedback", "content", "observation")
"""Where an observation's text is looked for, in order, when no template is given."""

_POOL = ThreadPoolExecutor(max_workers=256, thread_name_prefix="openenv")
"""Sessions wait on the network, not the CPU: every episode's reset and step runs here at once
(asyncio's default pool has a few workers: 64 episodes' steps would queue behind them)."""


@dataclass(frozen=True)
class Options:
    url: str
    transport: str = "ws"
    action_field: str = "message"
    action_args: dict[str, Any] = field(default_factory=dict)
    reset_args: dict[str, Any] = field(default_factory=dict)
    reset_fields: tuple[str, ...] = ()
    step_fields: tuple[str, ...] = ()
    observation_template: str | None = None
    reward: str = "sum"
    timeout: float = 60.0

    @classmethod
    def of(cls, kwargs: dict[str, Any]) -> Options:
        check_names("env.kwargs for openenv", kwargs, sorted(cls.__dataclass_fields__))
        if not isinstance(kwargs.get("url"), str) or not kwargs["url"].startswith(("http://", "https://", "ws://",
                                                                                   "wss://")):
            raise ValueError('env.name = "openenv" needs env.kwargs.url = "http://host:port", the OpenEnv server '
                             f"(got {kwargs.get('url')!r})")
        options = cls(**{**kwargs, "reset_fields": tuple(kwargs.get("reset_fields", ())),
                         "step_fields": tuple(kwargs.get("step_fields", ()))})
        if options.transport not in ("ws", "http"):
            raise ValueError(f'env.kwargs.transport must be "ws" or "http", not {options.transport!r}')
        if options.reward not in ("sum", "last"):
            raise ValueError(f'env.kwargs.reward must be "sum" or "last", not {options.reward!r}')
        timeout_seconds(options.timeout)
        return options

    @property
    def base(self) -> str:
        """The server's HTTP root."""
        return self.url.rstrip("/").replace("ws://", "http://", 1).replace("wss://", "https://", 1).removesuffix("/ws")

    @property
    def socket(self) -> str:
        return self.base.replace("http://", "ws://", 1).replace("https://", "wss://", 1) + "/ws"


class OpenEnvEpisode:
    """One episode on an OpenEnv server (see the module docstring). The reset starts when the
    episode is made, so a step's episodes all reset at once; `initial_observation` waits for it."""

    def __init__(self, example: Example, rewards: list[Any], **kwargs: Any) -> None:
        self.options = Options.of(kwargs)
        self.last_reward = 0.0
        self._session: Any = None
        self._step_data = {**self.options.action_args, **_fields(example, self.options.step_fields, "step_fields")}
        reset = {**self.options.reset_args, **_fields(example, ("seed",) if "seed" in example.fields else (), ""),
                 **_fields(example, self.options.reset_fields, "reset_fields")}
        self._reset: Future[Any] = _POOL.submit(self._open, reset)
        self._failed: InfrastructureError | None = None

    def initial_observation(self) -> str:
        try:
            result = self._reset.result()
        except InfrastructureError as e:  # the first step ends the episode "infra" with it
            self._failed = e
            return f"(the environment could not be reset: {e})"
        return self._text(result["observation"])

    async def step(self, action: str) -> StepResult:
        if self._failed is not None:
            raise self._failed
        data = {**self._step_data, self.options.action_field: action}
        result = await asyncio.get_running_loop().run_in_executor(_POOL, self._step, data)
        reward = float(result.get("reward") or 0.0)
        done = bool(result.get("done"))
        if self.options.reward == "last":  # a cumulative reward: each turn adds what it gained
            reward, self.last_reward = reward - self.last_reward, reward
        return StepResult(None if done else self._text(result["observation"]), reward=reward, done=done)

    def close(self) -> None:
        """End the session: after its reset has finished (an episode closed early, when another's
        factory failed, may still be connecting), without waiting for the server's goodbye."""
        def finish() -> None:
            with contextlib.suppress(Exception):
                self._reset.result(timeout=self.options.timeout)
            session, self._session = self._session, None
            if session is not None:
                _close(session)

        _POOL.submit(finish)

    # the transports: each raises InfrastructureError, saying what failed

    def _open(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.options.transport == "http":
            return _checked(_post(f"{self.options.base}/reset", data, self.options.timeout), "reset")
        from websockets.exceptions import InvalidHandshake, WebSocketException
        from websockets.sync.client import connect

        try:
            self._session = connect(self.options.socket, open_timeout=self.options.timeout, max_size=2 ** 27)
        except (OSError, InvalidHandshake, WebSocketException, TimeoutError) as e:
            raise InfrastructureError(f"cannot connect to the OpenEnv server at {self.options.socket}: "
                                      f"{type(e).__name__}: {e}") from e
        return self._exchange({"type": "reset", "data": data}, "reset")

    def _step(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.options.transport == "http":
            return _checked(_post(f"{self.options.base}/step", {"action": data}, self.options.timeout), "step")
        return self._exchange({"type": "step", "data": data}, "step")

    def _exchange(self, message: dict[str, Any], what: str) -> dict[str, Any]:
        from websockets.exceptions import ConnectionClosed

        if self._session is None:
            raise InfrastructureError(f"the {what} has no session: it was closed")
        try:
            self._session.send(json.dumps(message))
            reply = json.loads(self._session.recv(timeout=self.options.timeout))
        except TimeoutError as e:
            raise InfrastructureError(f"the OpenEnv server did not answer the {what} within {self.options.timeout:g} s "
                                      "(env.kwargs.timeout)") from e
        except ConnectionClosed as e:
            raise InfrastructureError(f"the connection to the OpenEnv server was lost during the {what}: {e}") from e
        except (OSError, ValueError) as e:
            raise InfrastructureError(f"the OpenEnv server's answer to the {what} could not be read: "
                                      f"{type(e).__name__}: {e}") from e
        if not isinstance(reply, dict) or reply.get("type") == "error":
            error = reply.get("data", {}) if isinstance(reply, dict) else {}
            code = error.get("code", "?") if isinstance(error, dict) else "?"
            hint = (" (the server's max_concurrent_envs must allow prompts_per_step × group_size sessions)"
                    if code == "CAPACITY_REACHED" else "")
            raise InfrastructureError(f"the OpenEnv environment failed the {what}: "
                                      f"{error.get('message') if isinstance(error, dict) else reply} ({code}){hint}")
        return _checked(reply.get("data"), what)

    def _text(self, observation: Any) -> str:
        if not isinstance(observation, dict):
            return str(observation)
        if self.options.observation_template is not None:
            try:
                return self.options.observation_template.format(**observation)
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(f"env.kwargs.observation_template {self.options.observation_template!r} does not fit "
                                 f"the observation (fields {', '.join(observation)}): {e}") from e
        for name in OBSERVATION_FIELDS:
            if isinstance(observation.get(name), str) and observation[name].strip():
                return str(observation[name])
        return json.dumps(observation)


def _fields(example: Example, names: tuple[str, ...], key: str) -> dict[str, Any]:
    missing = [name for name in names if name not in example.fields]
    if missing:
        raise ValueError(f"{example.id}: env.kwargs.{key} names {', '.join(missing)}, which the example lacks (it has "
                         f"{', '.join(sorted(example.fields))})")
    return {name: example.fields[name] for name in names}


def _checked(result: Any, what: str) -> dict[str, Any]:
    if not isinstance(result, dict) or "observation" not in result:
        raise InfrastructureError(f"the OpenEnv server's answer to the {what} has no observation: {result!r:.200}")
    return result


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise InfrastructureError(f"the OpenEnv server answered {url} with HTTP {e.code}: "
                                  f"{e.read()[:300].decode(errors='replace')}") from e
    except (OSError, ValueError) as e:  # refused, reset, timed out, not JSON
        raise InfrastructureError(f"the OpenEnv server at {url} failed: {type(e).__name__}: {e}") from e


def _close(session: Any) -> None:
    try:
        session.send(json.dumps({"type": "close"}))
    except Exception:  # noqa: BLE001 - a session already gone is closed
        pass
    finally:
        session.close()


def examples(env_kwargs: dict[str, Any], size: int) -> list[Example]:
    """`size` examples for task.source = "env": reset seeds 0, 1, ... (see the module docstring)."""
    Options.of(env_kwargs)
    return [Example(f"OpenEnv episode, reset seed {k}", None, {"seed": k}, f"openenv/{k}") for k in range(size)]


def check(env: Any) -> None:
    """Before the model loads: the server answers (GET /health, else a WebSocket handshake)."""
    options = Options.of(dict(env.kwargs))
    if options.transport == "ws":
        try:
            import websockets  # noqa: F401
        except ImportError:
            raise ImportError("env.name = \"openenv\" speaks OpenEnv's WebSocket with the websockets package: "
                              "pip install 'rlvr[openenv]' (or env.kwargs.transport = \"http\")") from None
    try:
        with urllib.request.urlopen(f"{options.base}/health", timeout=min(options.timeout, 30.0)):
            return
    except urllib.error.HTTPError:  # it answers, without that route
        return
    except OSError as e:
        raise ConnectionError(f"the OpenEnv server at {options.base} cannot be reached ({e}); start it, or fix "
                              "env.kwargs.url") from e
