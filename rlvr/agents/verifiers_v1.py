"""verifiers v1 environments (Taskset, Task, Harness, Env, Toolset), trained unchanged.

    [env]
    name = "verifiers"
    kwargs = {v1 = {taskset = {id = "my-taskset"}, agent = {harness = {id = "null"}}}}

`env.kwargs.v1` is the environment's own `[env]` block, as verifiers' `eval` reads it: the seed
taskset (an installed package, by id), the seats (`agent` for a plain taskset), an `id` pairing
another Env. Its tasks become the run's prompts (`task.source = "env"`); each rlvr episode is one
`Env.run_episode` of a task, whose model calls go through verifiers' interception to rlvr's
OpenAI-compatible server for the episode (rlvr.agents.openai_agent): the trajectory is the calls'
exact token ids, and the run's sampling settings and env limits hold. The episode's reward is its
trace's: the task's `@reward` functions and judges, weighted as verifiers weighs them.

What rlvr sets where the block is silent, and why:
- a seat's `runtime` is `{type = "subprocess"}` where neither the block nor the Env chose one
  (verifiers' stock default is a Prime cloud sandbox, which needs a Prime account);
- a seat on verifiers' `null` harness (its chat loop, MCP tools included) runs that harness's own
  program in this process (harness id `rlvr-null`), where verifiers would start it with `uv run`
  per episode: ~2 s an episode on a 2-core CPU. Every other harness runs as verifiers runs it
  (with `uv`, which verifiers installs with pip where it is missing, and in containers where the
  harness says so).

An episode is scored only when verifiers says it finished (`episode.ok`); a failure of the
harness, a tool server, the task's setup or scoring, or the interception raises, and rlvr counts
the episode as failed (env/error, excluded from the update), or as the limit it hit where rlvr's
server refused a call (max_turns, max_total_tokens).

Only the policy's seats may call the policy: an Env seat that is not trainable (a simulated user,
a judge) must name its own `model` and `client`, since every call through rlvr's server is
recorded as the policy's tokens.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import copy
import functools
import json
import os
import tempfile
import sys
import threading
import types
from collections.abc import Coroutine
from typing import Any

from rlvr.data.tasks import Example

TASK_INDEX = "verifiers_v1_task"
"""The example field holding the task's position in the taskset."""

KEY_VARIABLE = "RLVR_VERIFIERS_API_KEY"
"""The variable verifiers' client reads the key of rlvr's server from (a client config names a
variable, not a key)."""


def _import_v1() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError:
        raise ImportError("env.kwargs.v1 needs the verifiers package with its v1 stack: pip install "
                          "'rlvr[verifiers]'") from None
    return vf


def env_config(block: dict[str, Any]) -> Any:
    """The verifiers EnvConfig of `block`, validated by verifiers (its errors name the field),
    with every seat that names no runtime on the local subprocess runtime."""
    vf = _import_v1()
    _in_process_null()  # before validation, which resolves harness ids
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import environment_class

    if not isinstance(block, dict):
        raise ValueError(f"env.kwargs.v1 must be a table (the verifiers [env] block), got {block!r}")
    taskset = block.get("taskset")
    taskset_id = taskset.get("id") if isinstance(taskset, dict) else None
    if not isinstance(taskset_id, str) or not taskset_id:
        raise ValueError('env.kwargs.v1 needs taskset = {id = "..."}: the installed taskset package to train on')
    cls = environment_class(taskset_id, str(block.get("id") or ""))
    config_cls = concrete_type(cls, vf.EnvConfig, origin=vf.Env) or vf.EnvConfig
    config = config_cls.model_validate(copy.deepcopy(block))  # verifiers' validators fill in the dict they get
    from verifiers.v1.runtimes import PrimeConfig, SubprocessConfig

    seats = [name for name, field in type(config).model_fields.items() if isinstance(field.default, vf.AgentConfig)]
    for name, spec in ((name, getattr(config, name)) for name in seats):
        seat = block.get(name)
        if not (isinstance(seat, dict) and "runtime" in seat) and spec.runtime == PrimeConfig():
            spec.runtime = SubprocessConfig()  # verifiers' stock default; an Env's own choice stays
        if spec.harness is not None and spec.harness.id == "null":
            spec.harness = type(spec.harness).model_validate({**spec.harness.model_dump(), "id": IN_PROCESS_NULL})
    return config


def _chat_program() -> types.ModuleType:
    """verifiers' chat program, the script its null harness runs with `uv run` (0.3: its own
    program; 0.4: the chat program bundled from `harnesses.utils`), executed here as a module:
    the same source, its `__main__` entry point inert."""
    from verifiers.v1.harnesses.null import harness

    source = getattr(harness, "CHAT_PROGRAM_SOURCE", None) or getattr(harness, "PROGRAM_SOURCE", None)
    if not isinstance(source, str):
        raise ImportError(f"this verifiers ({_version()}) has no chat program source in its null harness; rlvr "
                          f"supports verifiers {SUPPORTED}")
    module = types.ModuleType("verifiers_chat_program")
    exec(compile(source, "<verifiers' chat program>", "exec"), module.__dict__)
    return module


def _version() -> str:
    import verifiers

    return str(getattr(verifiers, "__version__", "?"))


SUPPORTED = "0.3.1 and 0.4.0"
"""The verifiers versions whose v1 stack this adapter is tested against."""


PROGRAM_DEFAULTS = {"system_prompt": "", "prompt": "", "initial_messages_file": "", "mcp_config": "",
                    "tool_interception_url": "", "bash": False, "compaction": False, "summarize_at_tokens": None,
                    "edit": False, "search": False, "serper_key": ""}
"""The chat program's command-line defaults (0.3's and 0.4's options): the null harness passes
only the model's endpoint, the prompt and the tool servers."""


IN_PROCESS_NULL = "rlvr-null"
"""The harness id rlvr gives a seat that names verifiers' `null` harness: the same program, run in
this process (a module `rlvr_null`, which verifiers' loader finds among the imported modules)."""


@functools.cache
def _in_process_null() -> type:
    from verifiers.v1.harnesses.null import NullHarness
    from verifiers.v1.runtimes import ProgramResult

    program = _chat_program()

    class InProcessNullHarness(NullHarness):
        """verifiers' null harness with its program run in this process: the same loop (chat, MCP
        tools listed and called, tool errors returned to the model), given the arguments the
        harness would pass on its command line. verifiers allows this: a harness may run its
        loop in-process as long as every model call goes through the interception endpoint."""

        async def setup(self, runtime: Any) -> None:
            return None  # nothing to install: the program's imports are this process's

        async def launch(self, ctx: Any, trace: Any, runtime: Any, endpoint: str, secret: str,
                         mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> Any:
            from verifiers.v1.dialects.chat import message_to_wire

            system_prompt, prompt = self.resolve_prompt(data)
            args = types.SimpleNamespace(**{**PROGRAM_DEFAULTS, "base_url": endpoint, "api_key": secret,
                                            "model": ctx.model, "system_prompt": system_prompt or "",
                                            "tool_interception_url": tool_interception_url or ""})
            if mcp_urls:
                args.mcp_config = json.dumps({"mcpServers": {name: {"url": url, "timeout": self.config.tool_timeout}
                                                             for name, url in mcp_urls.items()}})
            if isinstance(prompt, str):
                args.prompt = prompt
            elif prompt is not None:  # the program reads (and deletes) a Messages prompt from a file
                fd, args.initial_messages_file = tempfile.mkstemp(prefix="rlvr-vf-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump([message_to_wire(m) for m in prompt], f)
            # the program's own main, reading these arguments instead of its command line (a function
            # over a copy of its globals: concurrent episodes each see their own)
            main = types.FunctionType(program.main.__code__, {**vars(program), "parse_args": lambda: args})
            try:
                await main()
            except SystemExit as e:  # the program's exit on a lost model connection: a failed run, not ours
                code = e.code if isinstance(e.code, int) and e.code else 1
                return ProgramResult(exit_code=code, stdout="", stderr=f"the chat program exited {code}: {e!r}")
            finally:
                with contextlib.suppress(FileNotFoundError):
                    if args.initial_messages_file:
                        os.unlink(args.initial_messages_file)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType("rlvr_null", "verifiers' null harness, its program run in rlvr's process")
    module.InProcessNullHarness = InProcessNullHarness  # type: ignore[attr-defined]
    module.__all__ = ["InProcessNullHarness"]  # type: ignore[attr-defined]
    sys.modules.setdefault("rlvr_null", module)
    return InProcessNullHarness


class V1Environment:
    """One verifiers v1 Env for the run, served on an event loop of its own (a daemon thread):
    rlvr runs each step's episodes in a fresh loop, while verifiers' serving resources (its
    interception server, the taskset's shared tool servers) live for the run."""

    def __init__(self, block: dict[str, Any]) -> None:
        from verifiers.v1.utils.loaders import load_environment

        self.config = env_config(block)
        self.env = load_environment(self.config)
        taskset = self.env.taskset
        self.tasks = list(taskset if not taskset.INFINITE else taskset.head(10_000))
        if not self.tasks:
            raise ValueError(f"the verifiers taskset {self.config.taskset.id!r} has no tasks")
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="verifiers-v1", daemon=True).start()
        self._serving: contextlib.AsyncExitStack | None = None
        self._root: str | None = None
        self._lock: asyncio.Lock | None = None
        atexit.register(self.close)

    def examples(self) -> list[Example]:
        out = []
        for k, task in enumerate(self.tasks):
            data = task.data
            answer = getattr(data, "answer", None)
            out.append(Example(prompt=data.prompt_text, answer=None if answer is None else str(answer),
                               fields={TASK_INDEX: k}, id=f"verifiers/{data.name or task.key[:12]}"))
        return out

    def _run(self, coroutine: Coroutine[Any, Any, Any]) -> asyncio.Future[Any]:
        return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    async def _serve(self, root: str) -> None:
        """verifiers' serving resources, for episodes calling `root` (on the env's loop): started
        once; when the rlvr server changes, the clients verifiers keeps for the old one's episodes
        are closed (else each holds its connections for the run: one an episode)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._root == root:
                return
            if self._serving is not None and await self._forget_clients():
                self._root = root
                return
            if self._serving is not None:  # a verifiers whose interception keeps its clients elsewhere
                self._root, serving, self._serving = None, self._serving, None
                await serving.aclose()
            serving = contextlib.AsyncExitStack()
            await serving.enter_async_context(self.env.serving())
            self._serving, self._root = serving, root

    async def _forget_clients(self) -> bool:
        """Close the interception's clients (one per endpoint, so one per episode here); False
        where its servers do not hold them as verifiers 0.3's do (then serving restarts)."""
        interception = self.env._interception
        servers = getattr(interception, "servers", [interception])
        if not all(isinstance(getattr(server, "clients", None), dict) for server in servers):
            return False
        for server in servers:
            clients, server.clients = server.clients, {}
            for client in clients.values():
                with contextlib.suppress(Exception):
                    await client.close()
        return True

    async def _episode(self, task: Any, ctx: Any, root: str) -> Any:
        await self._serve(root)
        return await self.env.run_episode(task, ctx)

    async def episode(self, client: Any, row: dict[str, Any]) -> float:
        """One episode of the row's task, its model calls to `client`'s server: the trace's reward."""
        from verifiers.v1.clients import EvalClientConfig, ModelContext

        base_url = str(client.base_url).rstrip("/")
        os.environ[KEY_VARIABLE] = client.api_key  # one key per rlvr server, all of a step's episodes share it
        ctx = ModelContext(model="policy", client=EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE))
        root = base_url.split("/e/", 1)[0]
        episode = await self._run(self._episode(self.tasks[int(row[TASK_INDEX])], ctx, root))
        return reward_of(episode, base_url)

    def close(self) -> None:
        """Stop serving (tool servers, the interception) and the loop; idempotent."""
        if not self._loop.is_running():
            return
        if self._serving is not None:
            serving, self._serving = self._serving, None
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(serving.aclose(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)


class EpisodeFailed(RuntimeError):
    """verifiers did not finish the episode (its errors say why)."""


def reward_of(episode: Any, policy_url: str) -> float:
    """The reward of a finished episode: its one trainable trace's (verifiers' weighted sum).
    `policy_url` is the episode's endpoint on rlvr's server."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if not episode.ok or errors:
        first = errors[0] if errors else None
        why = f"{first.type}: {first.message}" if first is not None else "it did not finish"
        raise EpisodeFailed(f"the verifiers episode failed ({why})")
    for t in episode.traces:  # a seat that is not the policy, calling rlvr's server, would be trained as the policy
        client = getattr(t.agent.config, "client", None)
        if not t.agent.trainable and t.calls and str(getattr(client, "base_url", "")).rstrip("/") == policy_url:
            raise EpisodeFailed(f"the verifiers seat {t.agent.name!r} is not trainable but called the policy's "
                                "server, whose calls all train the policy: give it its own model and client")
    trained = [t for t in episode.traces if t.agent.trainable]
    if len(trained) != 1:
        raise EpisodeFailed(f"the verifiers episode has {len(trained)} trainable traces; rlvr trains episodes with "
                            "one (a seat that is not the policy must be marked trainable = False and call its own "
                            "model)")
    return float(trained[0].reward)


@functools.cache
def environment(block_json: str) -> V1Environment:
    """The run's environment for a v1 block (one per process per block)."""
    return V1Environment(json.loads(block_json))


def of(block: dict[str, Any]) -> V1Environment:
    return environment(json.dumps(block, sort_keys=True, default=str))
