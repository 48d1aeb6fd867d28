"""A user's own model, end to end: `rlbus model init --arch qwen3` writes a Qwen3 model
with a BPE tokenizer and a Qwen3-style chat template; `rlbus up -c smoke model.path=X`
trains it with every role, the traces hold the template's tokens, the trainer replays bit
for bit, and `rlbus model export` gives a loadable model back. With a renderer that
cannot render the template exactly, `rlbus up` refuses before any role starts."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bus.server import EmbeddedServer
from roles.lib.model.loading import load_tokenizer
from schemas import TraceCompleted
from tests.e2e.helpers import all_events, rlbus, rlbus_up, summary

pytestmark = pytest.mark.e2e

RUN = "byo"
STEPS = 6


def test_a_qwen3_model_trains_replays_and_exports(tmp_path: Path) -> None:
    model = tmp_path / "qwen3"
    made = rlbus(tmp_path, "model", "init", "--arch", "qwen3", "--out", str(model))
    assert made.returncode == 0, made.stderr
    assert (model / "tokenizer.json").exists() and (model / "chat_template.jinja").exists()

    refused = rlbus_up(tmp_path, "norun", f"model.path={model}", "model.renderer=rlbus")
    out, _ = refused.communicate(timeout=120)
    assert refused.returncode == 2 and "`model.renderer` ('rlbus' = 'rlbus') cannot render" in out
    assert not (tmp_path / "norun").exists()

    proc = rlbus_up(tmp_path, RUN, f"model.path={model}", f"max_steps={STEPS}")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-4000:]
    assert summary(tmp_path, RUN)["steps"] == STEPS

    tok = load_tokenizer(model)
    with EmbeddedServer(tmp_path / RUN / "nats") as server:
        events = asyncio.run(all_events(server.url, RUN))
    traces = [e.trace for e in events if isinstance(e, TraceCompleted) and e.trace.ok]
    assert traces
    for trace in traces[:20]:
        ids, sampled, _, _ = trace.branch_tokens(trace.branches[0])
        text = tok.decode(ids.tolist())
        assert text.startswith("<|im_start|>system\n") and "<|im_start|>assistant\n" in text
        assert sampled.any()

    replayed = rlbus(tmp_path, "replay", RUN, "trainer")
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert f"REPRODUCED {STEPS} steps" in replayed.stdout
    assert summary(tmp_path, RUN)["final_weights_digest"] in replayed.stdout

    exported = rlbus(tmp_path, "model", "export", RUN, "--out", str(tmp_path / "out"))
    assert exported.returncode == 0, exported.stderr
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == tok.chat_template
