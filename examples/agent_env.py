"""An agent env: the env's own code drives the conversation through the OpenAI client.

    rlbus rollout --env examples.agent_env:make_env -n 8 --group-size 4

The agent asks the policy an arithmetic question with a ``calc`` tool, runs every call
the model makes and sends back the results, until the model answers without a call
(or its turns run out). Each policy call is a turn of the trace, token for token
(``roles.lib.envs.agent``); the reward is 1 when the last answer is the sum.
"""

from __future__ import annotations

import random
from typing import Any

from roles.lib.envs.agent import AgentHarness
from roles.lib.envs.base import Environment, GeneratedTaskset, Messages, Rubric, State
from roles.lib.envs.builtin.calculator import TOOL_SCHEMA, run_call


class Sums(GeneratedTaskset):
    def generate(self, rng: random.Random) -> dict[str, Any]:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return {"question": f"{a}+{b}", "answer": str(a + b)}

    def key(self, task: dict[str, Any]) -> str:
        return str(task["question"])


class CalcAgent(AgentHarness):
    max_turns = 3

    async def run(self, client: Any, model: str, task: dict[str, Any], state: State) -> Messages:
        messages: Messages = [
            {"role": "system", "content": "Use calc, then answer with the number."},
            {"role": "user", "content": task["question"]},
        ]
        for _ in range(self.max_turns):
            r = await client.chat.completions.create(model=model, messages=messages,
                                                     tools=[TOOL_SCHEMA])  # fmt: skip
            said = r.choices[0].message
            messages.append(said.model_dump(exclude_none=True))
            if not said.tool_calls:
                break
            for call in said.tool_calls:
                args = {"name": call.function.name, "arguments": call.function.arguments}
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "content": run_call(args)}
                )
            state["calls"] = state.get("calls", 0) + len(said.tool_calls)
        return messages


def exact(messages: Messages, task: dict[str, Any], state: State) -> float:
    return float(str(messages[-1].get("content") or "").strip() == task["answer"])


def make_env(seed: int = 0) -> Environment:
    return Environment(
        "calc-agent", Sums(seed=seed), CalcAgent(), Rubric({"exact": exact}), {"seed": seed},
        state_columns=("calls",),
    )  # fmt: skip
