"""The OpenAI wire format of the gateway, without a server (the HTTP path and the official
client: tests/e2e/test_serve.py)."""

from __future__ import annotations

import json

import pytest

from configs import load_config
from roles.lib.model.render import Reply
from roles.lib.model.tokenizer import ParsedToolCall, build_tokenizer
from roles.lib.openai_api import (
    ApiError,
    ChatRequest,
    Choice,
    CompletionRequest,
    chat_messages,
    chat_response,
    parse_request,
)
from roles.up.launcher import role_commands


def body(**fields: object) -> bytes:
    return json.dumps({"model": "policy", **fields}).encode()


@pytest.mark.parametrize(
    ("raw", "param", "fragment"),
    [
        (b"{not json", None, "body is not JSON"),
        (b"[1]", None, "body must be a JSON object"),
        (body(messages=[]), "messages", "at least 1 item"),
        (body(messages=[{"role": "robot", "content": "x"}]), "messages", "role must be"),
        (body(messages=[{"role": "user", "content": "x"}], n=0), "n", "greater than or equal to 1"),
        (body(messages=[{"role": "user", "content": "x"}], stream=True), "stream", "not supported"),
        (body(messages=[{"role": "user", "content": "x"}], top_logprobs=3), "top_logprobs", "0"),
        (
            json.dumps({"messages": [{"role": "user", "content": "x"}]}).encode(),
            "model",
            "required",
        ),
    ],
)
def test_a_bad_request_is_a_400_naming_its_field(
    raw: bytes, param: str | None, fragment: str
) -> None:
    with pytest.raises(ApiError) as e:
        parse_request(ChatRequest, raw)
    assert e.value.status == 400 and e.value.param == param and fragment in e.value.message
    error = e.value.body()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_fields_are_accepted_and_budgets_resolve() -> None:
    req = parse_request(ChatRequest, body(messages=[{"role": "developer", "content": [
        {"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]}], user="u1",
        max_tokens=9, stop="\n"))  # fmt: skip
    assert req.budget(256) == 9 and req.stops() == ["\n"]
    assert chat_messages(req.messages) == [{"role": "system", "content": "be brief"}]
    assert parse_request(CompletionRequest, body(prompt=[1, 2, 3])).budget(256) == 256


def test_a_tool_call_reply_is_a_tool_calls_choice_with_its_tokens() -> None:
    tok = build_tokenizer()
    ids = tok.encode("hi", add_special_tokens=False)
    reply = Reply("hi", "", None, [ParsedToolCall("calc", '{"expr":"1+1"}')], None)
    out = chat_response(
        "r1", "policy", [5, 6], [Choice(ids, [-0.5, -0.25], "stop", reply, 3)], tok, True
    )
    (choice,) = out["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["token_ids"] == ids
    assert choice["message"]["tool_calls"][0]["function"] == {
        "name": "calc",
        "arguments": '{"expr":"1+1"}',
    }
    assert [x["logprob"] for x in choice["logprobs"]["content"]] == [-0.5, -0.25]
    assert out["prompt_token_ids"] == [5, 6] and out["usage"]["total_tokens"] == 4
    assert choice["policy_version"] == 3


def test_up_starts_the_gateway_only_when_enabled() -> None:
    assert "gateway" not in dict(role_commands(load_config("smoke")))
    assert dict(role_commands(load_config("smoke", ["gateway.enabled=true"])))["gateway"] == [
        "gateway"
    ]
