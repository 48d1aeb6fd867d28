"""Single turn: answer ``a+b`` with the number."""

import verifiers.v1 as vf


class AddData(vf.TaskData):
    answer: str


class AddTask(vf.Task[AddData]):
    @vf.reward
    async def exact(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.reward(weight=0.1)
    async def brief(self, trace: vf.Trace) -> float:
        return max(0.0, 1.0 - len(trace.last_reply) / 40)

    @vf.metric
    async def reply_chars(self, trace: vf.Trace) -> float:
        return float(len(trace.last_reply))


class AddConfig(vf.TasksetConfig):
    num_tasks: int = 64


class AddTaskset(vf.Taskset[AddTask, AddConfig]):
    def load(self) -> list[AddTask]:
        return [
            AddTask(
                AddData(prompt=f"What is {i % 7}+{i % 5}?", answer=str(i % 7 + i % 5)),
                self.config.task,
            )
            for i in range(self.config.num_tasks)
        ]


def load_environment(num_tasks: int = 64) -> AddTaskset:
    """The taskset, configured: what a verifiers-style ``load_environment`` returns."""
    return AddTaskset(AddConfig(num_tasks=num_tasks))


__all__ = ["AddTaskset"]
