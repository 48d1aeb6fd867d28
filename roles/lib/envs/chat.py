"""The chat side of a rollout: recorded messages as the chat dicts an env sees, a reply
parsed into tool calls, and the checks that tell a bug in env code (``EnvCodeError``)
from a model's mistake. Pure; the token side is ``roles.lib.envs.harness``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from roles.lib.envs.base import EnvCodeError, Messages
from roles.lib.model.render import Reply
from schemas import Message, ToolCall, derive_id


def chat_calls(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """Recorded calls as the OpenAI-style ``tool_calls`` of a chat message."""
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]  # fmt: skip


def chat_message(m: Message) -> dict[str, Any]:
    """A recorded message as the chat dict the env saw (role, content, and ``name``,
    ``tool_calls``, ``tool_call_id`` when set): what rubric replay re-scores."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = chat_calls(m.tool_calls)
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.reasoning is not None:
        out["reasoning_content"] = m.reasoning
    return out


def reply_calls(reply: Reply, rollout_id: str, turn: int) -> tuple[str, list[ToolCall], str | None]:
    """(content, tool calls, parse error) of one reply (``Renderer.parse_reply``'s).

    A reply that starts a call that does not parse keeps its raw text as content, no
    calls, and the reason; call ids derive from the rollout, the turn and the call's
    position, so a rerun rollout names its calls the same.
    """
    calls = [
        ToolCall(id=derive_id(rollout_id, "turn", turn, "call", k), name=c.name,
                 arguments=c.arguments)
        for k, c in enumerate(reply.calls)
    ]  # fmt: skip
    return reply.content, calls, reply.error


def resolve_tool_names(new: Messages, calls: dict[str, ToolCall]) -> Messages:
    """The env's messages with each nameless tool message named after the call it
    answers (``tool_call_id``), so the template writes the name and SFT can filter by it."""
    out = []
    for m in new:
        call = calls.get(m.get("tool_call_id") or "")
        if m.get("role") == "tool" and not m.get("name") and call is not None:
            m = {**m, "name": call.name}
        out.append(m)
    return out


def check_messages(env: str, hook: str, messages: Any) -> Messages:
    """``messages`` as a list of chat dicts, else the env's bug (``EnvCodeError``)."""
    if not isinstance(messages, (list, tuple)):
        raise EnvCodeError(
            env, "TypeError", f"{hook} returned {messages!r}, not a list of messages"
        )
    out = list(messages)
    for m in out:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise EnvCodeError(env, "TypeError", f"{hook} returned {m!r}, not a chat message dict")
    return out


def check_response(env: str, response: Any) -> tuple[Messages, bool]:
    """``env_response``'s ``(messages, done)``, else the env's bug (``EnvCodeError``)."""
    if not isinstance(response, tuple) or len(response) != 2:
        raise EnvCodeError(env, "TypeError", f"env_response returned {response!r}, not (messages, done)")  # fmt: skip
    return check_messages(env, "env_response", response[0]), bool(response[1])


def state_columns(env: str, columns: Sequence[str], state: Any) -> dict[str, Any]:
    """The declared state columns, as JSON gives them back: None for one the state does
    not hold (yet: a rollout that ended early), ``EnvCodeError`` naming a column that is
    not JSON-able."""
    out: dict[str, Any] = {}
    for key in columns:
        if not isinstance(state, dict) or key not in state:
            out[key] = None
            continue
        try:
            out[key] = json.loads(json.dumps(state[key], allow_nan=False))
        except (TypeError, ValueError) as e:
            raise EnvCodeError(
                env, "TypeError", f"state column {key!r} is not JSON-able: {e}"
            ) from e
    return out
