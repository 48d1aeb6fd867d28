"""Tool use: add two numbers with the ``calc_add`` tool, then answer."""

import verifiers.v1 as vf

from tests.vf_envs.calc_tools import CalcToolset


class CalcData(vf.TaskData):
    answer: str


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)


class CalcConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class CalcTaskset(vf.Taskset[CalcTask, CalcConfig]):
    def load(self) -> list[CalcTask]:
        return [
            CalcTask(
                CalcData(prompt=f"Use calc_add: what is {a}+{b}?", answer=str(a + b)),
                self.config.task,
            )
            for a, b in [(12, 34), (5, 7), (20, 22), (3, 9)]
        ]

    @classmethod
    def toolsets(cls, config: CalcConfig) -> list[vf.Toolset]:
        return [CalcToolset(config.tools)]


__all__ = ["CalcTaskset"]
