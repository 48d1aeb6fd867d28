"""Multi-turn: the model names a word, then a scripted user asks for it again."""

import verifiers.v1 as vf


class RecallData(vf.TaskData):
    word: str


class RecallTask(vf.Task[RecallData]):
    @vf.reward
    async def recalled(self, trace: vf.Trace) -> float:
        return float(trace.last_reply.strip() == self.data.word)


class RecallTaskset(vf.Taskset[RecallTask, vf.TasksetConfig]):
    def load(self) -> list[RecallTask]:
        words = ["apple", "stone", "river", "cloud"]
        return [RecallTask(RecallData(prompt=f"Say {w}.", word=w), self.config.task) for w in words]


class RecallConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()


class RecallEnv(vf.Env[RecallConfig]):
    async def run(self, task: vf.Task, agents: vf.Agents) -> None:
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            await chat.turn("Say it again.")


__all__ = ["RecallEnv", "RecallTaskset"]
