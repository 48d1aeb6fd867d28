"""The scripted teacher reads the conversation back from prompt tokens and answers correctly."""

from __future__ import annotations

import pytest

from roles.lib.envs.registry import make_env
from roles.lib.model.render import Renderer
from roles.lib.model.tokenizer import build_tokenizer

TOK = build_tokenizer()
R = Renderer(TOK)


@pytest.mark.parametrize("env_id", ["reverse-text", "alphabet-sort", "tool-calc"])
def test_teacher_solves_every_turn_from_the_prompt_alone(env_id: str) -> None:
    """For held-out tasks, solve(parse(prompt tokens)) equals the env's reference answer, every
    turn, and the rubric gives the full reward to the teacher's conversation."""
    env = make_env(env_id, {})
    for index in range(20):
        task = env.task("eval", index)
        messages = env.initial_messages(task)
        state = env.init_state(task)
        for _ in range(env.max_turns):
            seen = R.read_conversation(R.render_prompt(messages))
            assert [(m["role"], m["content"], m.get("name")) for m in seen] == [
                (m["role"], m["content"], m.get("name")) for m in messages
            ]
            answer = env.solve(seen)
            assert answer == env.reference_answer(messages, task)
            messages = [*messages, {"role": "assistant", "content": answer}]
            new, done = env.env_response(messages, task, state)
            messages += new
            if done:
                break
        assert env.score(messages, task, state).reward == 1.0
