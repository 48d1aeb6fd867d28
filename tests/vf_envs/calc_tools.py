"""The calculator tool server of ``calc`` (verifiers runs it as ``python -m``)."""

import verifiers.v1 as vf


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = "calc"

    @vf.tool
    async def add(self, a: int, b: int) -> int:
        """Add two integers."""
        return a + b


if __name__ == "__main__":
    CalcToolset.run()
