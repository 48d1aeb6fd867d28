"""`rlbus serve` and the official `openai` client: a chat completion with a tool call and
the exact tokens back, the text completions endpoint, OpenAI-style errors, and the key.

The served model is the tiny Qwen3 built here, first taught (a few seconds of plain
torch) to answer any question with one `calc` call, so that a tool call comes back
from the real engine, renderer and parser rather than from a script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
import torch

from roles.lib.envs.builtin.calculator import TOOL_SCHEMA
from roles.lib.model.families import build_family_model
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import make_renderer

pytestmark = pytest.mark.e2e

CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12+34"}}\n</tool_call>'
QUESTIONS = ["What is 12+34?", "Add 12 and 34.", "12+34 = ?"]


def tool_caller(out: Path) -> Path:
    """The tiny Qwen3 model, trained until its greedy answer to any of ``QUESTIONS``
    (with the calc tool offered) is ``CALL`` and the end of the turn."""
    base = build_family_model(out.parent / "base", "qwen3")
    tok, model = load_tokenizer(base), load_model(base)
    renderer = make_renderer(tok)
    target = tok.encode(CALL, add_special_tokens=False) + [renderer.end_token_id]
    rows = [
        renderer.render_prompt([{"role": "user", "content": q}], [TOOL_SCHEMA]) for q in QUESTIONS
    ]
    seqs = [(torch.tensor([p + target]), len(p)) for p in rows]
    torch.manual_seed(0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(200):
        loss = sum(
            torch.nn.functional.cross_entropy(
                model(input_ids=ids).logits[0, n - 1 : -1], ids[0, n:]
            )
            for ids, n in seqs
        )
        opt.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        opt.step()
        if float(loss.detach()) < 1e-3:  # type: ignore[union-attr]
            break
    model.eval().save_pretrained(out)
    for f in base.iterdir():
        if f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("serve")
    model = tool_caller(data / "model")
    env = {**os.environ, "RLBUS_DATA_DIR": str(data)}
    env.pop("RLBUS_NATS_URL", None)
    cmd = [sys.executable, "-m", "roles.cli", "serve", "--model", str(model), "--port", "0",
           "--run", "srv"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("base_url=http://127.0.0.1:"), (
            line,
            proc.stderr.read() if proc.poll() is not None and proc.stderr else "",
        )
        fields = dict(part.split("=", 1) for part in line.split())
        yield fields["base_url"], fields["api_key"], model
    finally:
        proc.send_signal(signal.SIGTERM)  # serves until told to stop, then stops its roles
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    assert proc.returncode == 0, err[-3000:]


def test_a_chat_completion_with_a_tool_call_and_its_tokens(served) -> None:  # type: ignore[no-untyped-def]
    base_url, key, model = served
    client = openai.OpenAI(base_url=base_url, api_key=key)
    assert [m.id for m in client.models.list().data] == [
        "policy"
    ]  # (the smoke config's teacher is not served)

    messages = [{"role": "user", "content": QUESTIONS[0]}]
    r = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL_SCHEMA],
                                       temperature=0, max_tokens=40, logprobs=True, n=2)  # fmt: skip
    tok = load_tokenizer(model)
    renderer = make_renderer(tok)
    body = r.model_dump()
    assert body["prompt_token_ids"] == renderer.render_prompt(messages, [TOOL_SCHEMA])
    assert len(r.choices) == 2
    for choice, raw in zip(r.choices, body["choices"], strict=True):
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "calc" and json.loads(call.function.arguments) == {
            "expr": "12+34"
        }
        assert raw["token_ids"] == tok.encode(CALL, add_special_tokens=False) + [
            renderer.end_token_id
        ]
        lps = [x["logprob"] for x in raw["logprobs"]["content"]]
        assert len(lps) == len(raw["token_ids"]) and all(lp <= 0 for lp in lps)
    assert r.usage is not None and r.usage.prompt_tokens == len(body["prompt_token_ids"])

    # A session's requests go to one replica (its own subject): the same answer here.
    again = client.chat.completions.create(model="policy", messages=messages, tools=[TOOL_SCHEMA],
                                           temperature=0, max_tokens=40,
                                           extra_headers={"X-Session-ID": "conversation-1"})  # fmt: skip
    assert again.model_dump()["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]

    text = client.completions.create(model="policy", prompt="Hello", max_tokens=3, temperature=0)
    assert len(text.model_dump()["choices"][0]["token_ids"]) <= 3

    # vLLM's token-in endpoint (verifiers' and prime-rl's training clients): the same prompt
    # rendered by the caller gives the same greedy completion, one logprob per token.
    prompt = body["prompt_token_ids"]
    raw = client.post(f"{base_url.removesuffix('/v1')}/inference/v1/generate", cast_to=object,
                      body={"model": "policy", "token_ids": prompt,
                            "sampling_params": {"temperature": 0, "max_tokens": 40}})  # fmt: skip
    assert isinstance(raw, dict) and raw["prompt_token_ids"] == prompt
    (tokens,) = raw["choices"]
    assert tokens["token_ids"] == body["choices"][0]["token_ids"]
    assert [x["token"] for x in tokens["logprobs"]["content"]] == [
        f"token_id:{t}" for t in tokens["token_ids"]
    ]


def test_bad_requests_get_openai_errors_and_keys_are_checked(served) -> None:  # type: ignore[no-untyped-def]
    base_url, key, _ = served
    client = openai.OpenAI(base_url=base_url, api_key=key, max_retries=0)
    cases = [
        (dict(model="nope", messages=[{"role": "user", "content": "x"}]), 404, "model"),
        (dict(model="policy", messages=[]), 400, "messages"),
        (dict(model="policy", messages=[{"role": "user", "content": "x"}], temperature=5), 400, "temperature"),
        (dict(model="policy", messages=[{"role": "robot", "content": "x"}]), 400, "messages"),
    ]  # fmt: skip
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as e:
            client.chat.completions.create(**kwargs)
        assert e.value.status_code == status
        error = e.value.body
        assert isinstance(error, dict) and error["param"] == param and error["message"], error
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0).models.list()
    request = urllib.request.Request(f"{base_url}/models")  # no key at all
    with pytest.raises(urllib.error.HTTPError) as no_key:
        urllib.request.urlopen(request, timeout=10)
    assert (
        no_key.value.code == 401
        and json.loads(no_key.value.read())["error"]["code"] == "invalid_api_key"
    )
    # The gateway is still up.
    assert client.models.list().data
