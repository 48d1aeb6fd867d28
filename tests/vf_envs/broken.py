"""A bug in env code: the reward function divides by zero."""

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def ratio(self, trace: vf.Trace) -> float:
        return len(trace.last_reply) / 0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> list[BrokenTask]:
        return [BrokenTask(vf.TaskData(prompt="Say hi."), self.config.task)]


__all__ = ["BrokenTaskset"]
