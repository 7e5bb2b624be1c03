"""What a black-box agent may be, and how rlvr calls it (`env.name = "openai_agent"`).

An agent is whatever `env.kwargs.entry = "package.module:name"` names, in the forms people write:

    def run_episode(client, row)                        # sync or async, any parameter names
    def run_episode(client, model, row)
    def run_episode(client, row, *, model, base_url, api_key, episode_id, **kw)  # context by name
    an object whose `run` or `__call__` takes one of the above (a class is made once, with no arguments)
    an OpenAI Agents SDK `Agent`: run by the SDK's Runner on the row's prompt, the episode's client as its model
    a LangGraph graph (compiled): `ainvoke({"messages": [the row's prompt]}, config)`, the context in
        `config["configurable"]` (client, model, base_url, api_key, row, episode_id)

The context of an episode: `client` (an `openai.AsyncOpenAI` for an async agent, an `openai.OpenAI`
for a plain one, on the episode's own base URL), `model` (the name to ask for: any name is
served), `row` (the example's fields with `prompt`, `answer` and `id`), `base_url` and `api_key`
(for agents that make their own client), and `episode_id`. Parameters named like these get them by
name, wherever they stand; otherwise two required positional parameters are (client, row) and
three are (client, model, row). `env.kwargs.args = {...}` are passed to every call as keyword
arguments. A `**kwargs` parameter receives the context the signature did not name, and the args.

The signature is checked when the run starts, before the model loads (`agent_from_entry`): an
agent that cannot be called in one of these forms is an AgentSignatureError that shows them.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from rlvr.rewards.combine import load_object

FORMS = """the forms rlvr accepts (sync or async):
    def run_episode(client, row)
    def run_episode(client, model, row)
    def run_episode(client, row, *, model=..., base_url=..., api_key=..., episode_id=..., **kw)
    an object with such a `run` or `__call__` method (a class: made with no arguments)
    an OpenAI Agents SDK Agent, or a compiled LangGraph graph
(docs/interop.md, "Training black-box agents")"""


class AgentSignatureError(TypeError):
    """The entry cannot be called as an agent; the message shows the accepted forms."""


@dataclass(frozen=True)
class EpisodeContext:
    """What an episode's agent may be given (see the module docstring)."""

    client: Any
    model: str
    row: dict[str, Any]
    base_url: str
    api_key: str
    episode_id: str


CONTEXT = tuple(f.name for f in fields(EpisodeContext))


@dataclass(frozen=True)
class Agent:
    """An agent in one normalised form: `call(context)` runs an episode and returns what the
    agent returned (or an awaitable of it, where `asynchronous`)."""

    call: Callable[[EpisodeContext], Any]
    asynchronous: bool
    """Run on the event loop with an async client (else in a thread, with a sync client)."""


def agent_from_entry(entry: str, args: Mapping[str, Any] | None = None, *, max_turns: int = 10) -> Agent:
    """The agent `entry` names, checked (see the module docstring)."""
    if ":" not in entry and "." not in entry:
        raise AgentSignatureError(f"env.kwargs.entry = {entry!r}: name the agent as 'package.module:name'")
    try:
        obj = load_object(entry, "agent")
    except Exception as e:
        raise AgentSignatureError(f"env.kwargs.entry = {entry!r} could not be loaded: {type(e).__name__}: {e}") from e
    return as_agent(obj, f"env.kwargs.entry = {entry!r}", args or {}, max_turns=max_turns)


def as_agent(obj: Any, where: str, args: Mapping[str, Any], *, max_turns: int = 10) -> Agent:
    if isinstance(obj, type):
        try:
            obj = obj()
        except TypeError as e:
            raise AgentSignatureError(f"{where} is a class, and rlvr makes it with no arguments: {e}\n{FORMS}") from e
    if _is_agents_sdk_agent(obj):
        return _sdk_agent(obj, where, args, max_turns)
    if _is_langgraph_graph(obj):
        return _graph_agent(obj, args)
    if inspect.isfunction(obj) or inspect.ismethod(obj) or inspect.isbuiltin(obj):
        fn = obj
    elif callable(getattr(obj, "run", None)):
        fn, where = obj.run, f"{where} (its run method)"
    elif callable(obj):
        fn, where = obj.__call__, f"{where} (its __call__ method)"
    else:
        raise AgentSignatureError(f"{where} is a {type(obj).__name__}, not a function or an object with a run or "
                                  f"__call__ method\n{FORMS}")
    bound = bind(fn, where, args)
    asynchronous = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
    return Agent(bound, asynchronous)


def bind(fn: Callable[..., Any], where: str, args: Mapping[str, Any]) -> Callable[[EpisodeContext], Any]:
    """`fn` called from an episode's context: its parameters matched by name or by position (the
    module docstring), checked now so that a wrong signature fails before the run starts."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise AgentSignatureError(f"{where}: its signature cannot be read ({e})\n{FORMS}") from e
    P = inspect.Parameter
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    required = [p for p in positional if p.default is P.empty]
    var_kw = any(p.kind is P.VAR_KEYWORD for p in params)
    known = set(CONTEXT) | set(args)
    names = [p.name for p in required]
    if all(name in known for name in names):
        slots = names
    elif len(required) in (2, 3):
        slots = ["client", "row"] if len(required) == 2 else ["client", "model", "row"]
    else:
        raise AgentSignatureError(f"{where} takes {_shown(fn)}: rlvr cannot tell which of its parameters is the "
                                  f"client and which the row\n{FORMS}")
    taken = {p.name for p in required}
    by_name = [p.name for p in params if p.name not in taken and p.name in known
               and p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)]
    missing = [p.name for p in params if p.kind is P.KEYWORD_ONLY and p.default is P.empty and p.name not in known]
    if missing:
        raise AgentSignatureError(f"{where} takes {_shown(fn)}: rlvr has no value for its keyword "
                                  f"{', '.join(missing)} (give one in env.kwargs.args)\n{FORMS}")
    unknown = [k for k in args if k not in slots and k not in by_name and not var_kw]
    if unknown:
        raise AgentSignatureError(f"env.kwargs.args: {where} takes no keyword {', '.join(sorted(unknown))} "
                                  f"(it takes {_shown(fn)})")
    given = set(slots) | set(by_name)
    rest = [k for k in (*CONTEXT, *args) if k not in given] if var_kw else []
    if "row" not in given | set(rest) or not {"client", "base_url"} & (given | set(rest)):
        raise AgentSignatureError(f"{where} takes {_shown(fn)}: an agent needs the row (the task) and the client "
                                  f"(or base_url) to reach the policy\n{FORMS}")

    def value(context: EpisodeContext, name: str) -> Any:
        return args[name] if name in args else getattr(context, name)

    def call(context: EpisodeContext) -> Any:
        return fn(*(value(context, n) for n in slots), **{n: value(context, n) for n in (*by_name, *rest)})

    return call


def _shown(fn: Callable[..., Any]) -> str:
    try:
        return f"{getattr(fn, '__name__', 'it')}{inspect.signature(fn)}"
    except (TypeError, ValueError):
        return repr(fn)


def _is_agents_sdk_agent(obj: Any) -> bool:
    if type(obj).__module__.split(".")[0] != "agents":
        return False
    from agents import Agent as SdkAgent

    return isinstance(obj, SdkAgent)


def _sdk_agent(agent: Any, where: str, args: Mapping[str, Any], max_turns: int) -> Agent:
    """An OpenAI Agents SDK agent, run by the SDK's own loop on the row's prompt; every model
    call (its handoffs' too) goes through the episode's client. Its final output is the answer;
    running out of turns (the policy kept calling tools) is an empty answer."""
    if args:
        raise AgentSignatureError(f"env.kwargs.args: {where} is an Agents SDK Agent, which takes no arguments")

    async def call(context: EpisodeContext) -> str:
        from agents import MaxTurnsExceeded, OpenAIChatCompletionsModel, RunConfig, Runner

        model = OpenAIChatCompletionsModel(model=context.model, openai_client=context.client)
        try:
            result = await Runner.run(agent, context.row["prompt"], max_turns=max_turns,
                                      run_config=RunConfig(model=model, tracing_disabled=True))
        except MaxTurnsExceeded:
            return ""
        return str(result.final_output)

    return Agent(call, True)


def _is_langgraph_graph(obj: Any) -> bool:
    return type(obj).__module__.split(".")[0] == "langgraph" and callable(getattr(obj, "ainvoke", None))


def _graph_agent(graph: Any, args: Mapping[str, Any]) -> Agent:
    """A LangGraph graph, invoked on a `messages` state holding the row's prompt, with the
    episode's context (and env.kwargs.args) in `config["configurable"]`. What it ends with: a
    state's `reward` (a number) or `answer`, or else its last message's text, the answer."""

    async def call(context: EpisodeContext) -> Any:
        configurable = {**{name: getattr(context, name) for name in CONTEXT}, **args}
        state = await graph.ainvoke({"messages": [{"role": "user", "content": context.row["prompt"]}]},
                                    config={"configurable": configurable})
        return graph_outcome(state)

    return Agent(call, True)


def graph_outcome(state: Any) -> Any:
    if not isinstance(state, Mapping):
        raise TypeError(f"the graph ended with a {type(state).__name__}; expected a state (a mapping) with reward, "
                        "answer or messages")
    for key in ("reward", "answer"):
        if state.get(key) is not None:
            return state[key]
    messages = state.get("messages")
    if not messages:
        raise TypeError(f"the graph's final state has no reward, answer or messages (it has {', '.join(state)})")
    last = messages[-1]
    content = last.get("content") if isinstance(last, Mapping) else getattr(last, "content", last)
    return content if isinstance(content, str) else str(content)


async def awaited(value: Any | Awaitable[Any]) -> Any:
    """A sync agent may still return an awaitable (a decorated coroutine): its result."""
    return await value if inspect.isawaitable(value) else value
