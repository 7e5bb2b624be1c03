"""A calculator as an MCP server over stdio (configs/mcp_tools.toml), written with the `mcp`
package's FastMCP (`pip install mcp`):

    python -m rlvr.configs.mcp_calculator
"""

from __future__ import annotations

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


if __name__ == "__main__":
    server.run()
