"""MCP tools for rlvr's own episodes: the tools an MCP server lists become an episode's tools
(`env.kwargs.mcp` of `tool_math`; rlvr.agents.tools.Tool).

    [env]
    name = "tool_math"
    kwargs = {mcp = {command = "python", args = ["-m", "mypkg.tools"]}}   # a server over stdio
                                                                          # ("python": the one running rlvr)
    kwargs = {mcp = {url = "http://127.0.0.1:8000/mcp"}}                 # or over streamable HTTP

One session per process and server, opened the first time its tools are wanted and kept on a
thread of its own with its own event loop: an MCP session belongs to the loop that opened it, and
the runner's turns each run a loop of their own. Every episode calls through that one session, so
a server whose tools keep state between calls shares it among episodes.

A call's output is the text of its content (its structured content as JSON where it has no text).
A call the server reports failed (``isError``: arguments that do not fit, a tool that raised, an
unknown tool) is output the model reads, beginning "error:", and counts as a tool error. A session
that fails (the server died, no answer within ``timeout`` seconds) raises InfrastructureError: the
episode ends without a verdict (rlvr.agents.runner). A server that cannot be started or reached
when the first episode needs it stops the run with what failed.

Tested with the `mcp` package 1.30; written for 2.x too (results are read as their wire JSON, which
2.x did not change; its renamed HTTP transport is imported by either name), not run on 2.x.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import os
import sys
import threading
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from rlvr.agents.tools import Tool
from rlvr.errors import InfrastructureError
from rlvr.options import check_names

_SESSIONS: dict[str, McpSession] = {}
_LOCK = threading.Lock()


def mcp_tools(spec: dict[str, Any]) -> dict[str, Tool]:
    """The tools of the MCP server `spec` names ({command, args, env, cwd} or {url, headers}, and
    timeout), its session opened once per process."""
    key = json.dumps(spec, sort_keys=True, default=str)
    with _LOCK:
        if key not in _SESSIONS:
            _SESSIONS[key] = McpSession(spec)
        return _SESSIONS[key].tools()


class McpSession:
    def __init__(self, spec: dict[str, Any]) -> None:
        check_names("env.kwargs.mcp", spec, ["command", "args", "env", "cwd", "url", "headers", "timeout"])
        spec = dict(spec)
        self.timeout = float(spec.pop("timeout", 30.0))
        self.command, self.url = spec.pop("command", None), spec.pop("url", None)
        self.args, self.env, self.cwd = list(spec.pop("args", [])), spec.pop("env", None), spec.pop("cwd", None)
        self.headers = spec.pop("headers", None)
        if (self.command is None) == (self.url is None):
            raise ValueError('env.kwargs.mcp needs a server: {command = "python", args = ["server.py"]} (stdio) or '
                             '{url = "http://host:port/mcp"} (streamable HTTP)')
        self.where = self.url or " ".join([self.command, *self.args])
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="rlvr-mcp", daemon=True).start()
        self._closing = asyncio.Event()
        self._opened: asyncio.Future[Any] = self.loop.create_future()
        self._held = asyncio.run_coroutine_threadsafe(self._hold(), self.loop)
        try:
            self.listed: list[dict[str, Any]] = asyncio.run_coroutine_threadsafe(self._wait_open(), self.loop) \
                .result(self.timeout + 5)
        except (FutureTimeout, TimeoutError) as e:
            raise ConnectionError(f"the MCP server {self.where} did not answer within {self.timeout:g} s "
                                  "(env.kwargs.mcp.timeout)") from e
        except Exception as e:
            raise ConnectionError(f"the MCP server {self.where} could not be started or reached: "
                                  f"{type(e).__name__}: {e}") from e
        atexit.register(self.close)

    async def _wait_open(self) -> list[dict[str, Any]]:
        return await asyncio.wait_for(asyncio.shield(self._opened), self.timeout)

    async def _hold(self) -> None:
        """Open the session, list its tools, and keep it until `close`: the transports' contexts are
        entered and left in this one task, as anyio wants."""
        from mcp import ClientSession

        try:
            async with contextlib.AsyncExitStack() as stack:
                if self.command is not None:
                    from mcp import StdioServerParameters
                    from mcp.client.stdio import stdio_client

                    command = sys.executable if self.command == "python" else self.command  # rlvr's own Python
                    params = StdioServerParameters(command=command, args=self.args, cwd=self.cwd,
                                                   env={**os.environ, **self.env} if self.env else None)
                    errlog = stack.enter_context(open(os.devnull, "w"))
                    streams = await stack.enter_async_context(stdio_client(params, errlog=errlog))
                else:
                    streams = await stack.enter_async_context(_http_client(self.url, self.headers))
                self.session = await stack.enter_async_context(ClientSession(streams[0], streams[1]))
                await self.session.initialize()
                tools, cursor = [], None
                while True:
                    page = wire(await self.session.list_tools(cursor))
                    tools += page.get("tools", [])
                    cursor = page.get("nextCursor")
                    if not cursor:
                        break
                self._opened.set_result(tools)
                await self._closing.wait()
        except BaseException as e:  # noqa: BLE001 - the waiting caller is told
            if not self._opened.done():
                self._opened.set_exception(e if isinstance(e, Exception) else RuntimeError(repr(e)))

    def tools(self) -> dict[str, Tool]:
        return {t["name"]: Tool(self._caller(t["name"]), t["name"], t.get("description") or "",
                                t.get("inputSchema") or {"type": "object", "properties": {}})
                for t in self.listed}

    def _caller(self, name: str) -> Any:
        def call(**arguments: Any) -> str:
            return self.call(name, arguments)

        return call

    def call(self, name: str, arguments: dict[str, Any]) -> str:
        """The tool's output; "error: ..." where the server says the call failed."""
        future = asyncio.run_coroutine_threadsafe(self.session.call_tool(name, arguments), self.loop)
        try:
            result = wire(future.result(self.timeout))
        except (FutureTimeout, TimeoutError) as e:
            future.cancel()
            raise InfrastructureError(f"the MCP server {self.where} did not answer a call to {name} within "
                                      f"{self.timeout:g} s") from e
        except Exception as e:  # the session's transport: the server died, or the connection failed
            raise InfrastructureError(f"the MCP server {self.where} failed a call to {name}: "
                                      f"{type(e).__name__}: {e}") from e
        parts = [c.get("text", "") for c in result.get("content", []) if c.get("type") == "text"]
        text = "\n".join(parts) if parts else json.dumps(result.get("structuredContent"))
        return f"error: {text}" if result.get("isError") else text

    def close(self) -> None:
        """End the session (a stdio server's process with it)."""
        if self.loop.is_running() and not self._held.done():
            self.loop.call_soon_threadsafe(self._closing.set)
            with contextlib.suppress(Exception):
                self._held.result(timeout=10)


def _http_client(url: str, headers: dict[str, str] | None) -> Any:
    """mcp's streamable HTTP transport: `streamable_http_client` (mcp >= 1.2x and 2.x; headers through
    an httpx client), else the older `streamablehttp_client`."""
    try:
        from mcp.client.streamable_http import streamable_http_client
    except ImportError:
        from mcp.client.streamable_http import streamablehttp_client

        return streamablehttp_client(url, headers=headers)
    import httpx

    return streamable_http_client(url, http_client=httpx.AsyncClient(headers=headers) if headers else None)


def wire(model: Any) -> dict[str, Any]:
    """An MCP result as its JSON on the wire (camelCase keys in mcp 1.x and 2.x alike)."""
    return model.model_dump(by_alias=True, exclude_none=True, mode="json")  # type: ignore[no-any-return]


def describe(tools: dict[str, Tool]) -> str:
    """The tools for a prompt: each one's name, parameters (JSON schema) and description, and how to call."""
    lines = ['You can call these tools: write <tool_call>{"name": ..., "arguments": {...}}</tool_call> and you '
             "will see the result."]
    for t in tools.values():
        fields = {name: {k: v for k, v in field.items() if k != "title"} if isinstance(field, dict) else field
                  for name, field in t.parameters.get("properties", {}).items()}  # the titles only repeat the names
        lines.append(f"- {t.name}({json.dumps(fields)}): {t.description}".rstrip(": "))
    return "\n".join(lines)
