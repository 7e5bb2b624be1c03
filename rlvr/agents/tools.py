"""Tools: typed Python functions whose signature and docstring are their schema, the calls models
actually write, and a stateful Python interpreter that runs in the sandbox.

Calls are parsed from the two formats small open models produce:

- JSON inside ``<tool_call>…</tool_call>`` tags, ``{"name": ..., "arguments": {...}}`` (the
  Qwen/Hermes chat templates' convention);
- a fenced code block, ```` ```python … ``` ````, for the code interpreter (as tool-integrated
  reasoning models write code).

A malformed call is not an exception: it is a ``ToolCall`` with an ``error``, which the
environment reports back to the model as the tool's output (and counts).
"""

from __future__ import annotations

import inspect
import json
import re
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rlvr import sandbox
from rlvr.errors import InfrastructureError

_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", list: "array", dict: "object"}


@dataclass
class Tool:
    """A function the model may call, with the JSON schema derived from its signature."""

    fn: Callable[..., Any]
    name: str
    description: str
    parameters: dict[str, Any]

    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema chat templates put in the system prompt."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def __call__(self, **arguments: Any) -> Any:
        return self.fn(**arguments)


def tool(fn: Callable[..., Any]) -> Tool:
    """Make a Tool of a typed function: parameter types give the JSON types, the docstring's first
    paragraph the description, and ``name: meaning`` lines under "Args:" each parameter's."""
    hints = typing.get_type_hints(fn)
    doc = inspect.getdoc(fn) or ""
    description = doc.split("\n\n")[0].strip()
    arg_docs = dict(re.findall(r"^\s*(\w+)\s*(?:\([^)]*\))?:\s*(.+)$", doc.split("Args:", 1)[1], re.M)) \
        if "Args:" in doc else {}
    properties, required = {}, []
    for name, param in inspect.signature(fn).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        if name not in hints:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r} needs a type annotation (its JSON schema type)")
        hint = hints[name]
        origin = typing.get_origin(hint) or hint
        if origin not in _JSON_TYPES:
            raise TypeError(f"tool {fn.__name__}: parameter {name!r} has type {hint!r}; use int, float, str, "
                            "bool, list or dict")
        properties[name] = {"type": _JSON_TYPES[origin], **({"description": arg_docs[name]} if name in arg_docs else {})}
        if param.default is param.empty:
            required.append(name)
    return Tool(fn, fn.__name__, description, {"type": "object", "properties": properties, "required": required})


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    """Why the call could not be read (the model is told, and it counts as a tool error)."""


_TAGGED = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
_FENCED = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|$)", re.S)


def parse_tool_calls(text: str, *, code_tool: str | None = None) -> list[ToolCall]:
    """The calls in an action, in order. JSON calls in <tool_call> tags; with ``code_tool``
    (a tool's name), each fenced code block is a call to it with ``{"code": ...}``. An unclosed
    tag or fence at the end (a turn cut off, or stopped at the closing marker) still counts."""
    calls = []
    for body in _TAGGED.findall(text):
        try:
            data = json.loads(body.strip())
        except json.JSONDecodeError as e:
            calls.append(ToolCall("", error=f"the tool call is not valid JSON ({e.msg})"))
            continue
        except (ValueError, RecursionError) as e:  # an integer over 4300 digits; brackets nested too deep
            calls.append(ToolCall("", error=f"the tool call cannot be read ({type(e).__name__})"))
            continue
        if not isinstance(data, dict) or not isinstance(data.get("name"), str):
            calls.append(ToolCall("", error='a tool call needs {"name": ..., "arguments": {...}}'))
            continue
        arguments = data.get("arguments", data.get("parameters", {}))
        if isinstance(arguments, str):  # some models double-encode
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            calls.append(ToolCall(data["name"], error="the arguments must be a JSON object"))
            continue
        calls.append(ToolCall(data["name"], arguments))
    if code_tool is not None and "<tool_call>" not in text:
        calls += [ToolCall(code_tool, {"code": code}) for code in _FENCED.findall(text) if code.strip()]
    return calls


def call(tools: dict[str, Tool], c: ToolCall) -> tuple[str, bool]:
    """(output text, ok) of one call; errors become text the model can read, except an
    InfrastructureError (the sandbox could not run the code), which is raised."""
    if c.error:
        return f"error: {c.error}", False
    if c.name not in tools:
        return f"error: no tool named {c.name!r}; the tools are {', '.join(tools)}", False
    try:
        return str(tools[c.name](**c.arguments)), True
    except (InfrastructureError, sandbox.SandboxUnavailable):
        # not the model's mistake: the runner ends the episode without a verdict, or (no sandbox on
        # this machine at all) stops the run and says how to fix it, as the rewards do
        raise
    except TypeError as e:
        return f"error: bad arguments for {c.name}: {e}", False
    except Exception as e:  # noqa: BLE001 - the model sees what went wrong
        return f"error: {type(e).__name__}: {e}", False


class PythonInterpreter:
    """A stateful Python session for one episode, run in rlvr.sandbox. Each call runs every earlier
    cell again with its output discarded, then the new cell with its output returned, in one
    sandboxed process: the state carries over without a long-lived process to keep isolated.
    The cost grows with the number of cells, which episodes keep small. A cell that fails is not
    kept, so one mistake does not break every later call. Output is cut to ``max_output`` chars."""

    def __init__(self, limits: sandbox.Limits | None = None, max_output: int = 1000) -> None:
        self.cells: list[str] = []
        self.limits, self.max_output = limits, max_output
        self.calls = 0

    def run(self, code: str) -> str:
        """Run Python code and return what it printed (or the error)."""
        self.calls += 1
        # Python literals, not JSON: JSON writes 😀 as two escaped surrogates, which a Python
        # literal keeps as two lone ones (print then fails to encode them)
        program = _REPLAY.format(cells=repr(self.cells), cell=repr(code))
        result = sandbox.default_pool().sandbox.run_python(program, limits=self.limits)
        out = result.stdout
        if result.timed_out:
            out += "\nerror: the code ran out of time"
        elif result.killed_by_limit:
            out += f"\nerror: the code hit the {result.killed_by_limit} limit"
        elif result.exit_code == 0:
            self.cells.append(code)
        if result.exit_code not in (0, None) and not result.timed_out and not result.killed_by_limit:
            out += "\n" + result.stderr.strip().splitlines()[-1] if result.stderr.strip() else ""
        out = out.strip() or "(no output)"
        return out if len(out) <= self.max_output else out[: self.max_output] + " …(cut)"

    def as_tool(self) -> Tool:
        made = tool(self.run)
        made.name = "python"
        return made


# The sandboxed program: earlier cells silently, then the new one; the last expression is printed
# as in a REPL. Only the last line of a traceback reaches the model (stderr's last line).
_REPLAY = '''
import ast, contextlib, io, sys
cells, cell = {cells}, {cell}
scope = {{"__name__": "__main__"}}
with contextlib.redirect_stdout(io.StringIO()):
    for old in cells:
        exec(compile(old, "<cell>", "exec"), scope)
tree = ast.parse(cell)
last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
exec(compile(tree, "<cell>", "exec"), scope)
if last is not None:
    value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), scope)
    if value is not None:
        print(repr(value))
'''
