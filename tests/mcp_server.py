"""An MCP server for the tests: rlvr's example calculator (rlvr/configs/mcp_calculator.py, written
with the `mcp` package's FastMCP) with tools that fail in each way a server can:

    python tests/mcp_server.py                 # over stdio
    python tests/mcp_server.py http PORT       # over streamable HTTP, at /mcp
"""

from __future__ import annotations

import sys
import time

from rlvr.configs.mcp_calculator import server


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    return a / b


@server.tool()
def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def die() -> str:
    """End the server's process."""
    sys.exit(3)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "http":
        server.settings.port = int(sys.argv[2])
        server.run(transport="streamable-http")
    else:
        server.run()
