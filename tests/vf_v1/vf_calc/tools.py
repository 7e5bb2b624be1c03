"""The calculator: a verifiers Toolset, served over MCP (python -m vf_calc.tools)."""

import os

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig, vf.State]):
    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    @vf.tool
    async def crash(self) -> int:
        """Kill the tool server (a test's infrastructure failure)."""
        os._exit(1)


if __name__ == "__main__":
    CalcToolset.run()
