"""A calculator as an MCP server over stdio (configs/mcp_tools.toml), written with the `mcp`
package's FastMCP (`pip install mcp`):

    python -m rlvr.configs.mcp_calculator
"""

from __future__ import annotations

import re

try:
    from mcp.server.fastmcp import FastMCP
except ImportError:  # mcp 2.x renamed it
    from mcp.server import MCPServer as FastMCP  # type: ignore[no-redef,attr-defined]

server = FastMCP("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def subtract(a: int, b: int) -> int:
    """Subtract b from a."""
    return a - b


@server.tool()
def evaluate(expression: str) -> int:
    """Evaluate a sum or difference of integers, such as "12 + 30 - 7"."""
    terms = re.findall(r"\s*([+-]?)\s*(\d+)\s*", expression)
    written = "".join(f"{sign}{digits}" for sign, digits in terms)
    if not terms or not all(sign for sign, _ in terms[1:]) or written != re.sub(r"\s+", "", expression):
        raise ValueError(f"not a sum or difference of integers: {expression!r}")
    return sum(-int(digits) if sign == "-" else int(digits) for sign, digits in terms)


if __name__ == "__main__":
    server.run()
