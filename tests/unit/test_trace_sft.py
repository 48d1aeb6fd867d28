"""`rlbus trace` of a warm-start (SFT) sample shows what SFT trained.

Regression: the token table had one ``adv <algorithm>`` column per algorithm that scored
the rollout, so an SFT sample (its RL channel empty) showed a column of zero advantages
and nothing of the tokens it trained with cross-entropy.
"""

from __future__ import annotations

import io

import msgspec
from rich.console import Console

from replay.inspect import render_chain, trace_chain
from schemas import BatchAssembled, SamplesScored, TraceCompleted
from schemas.arrays import pack_f32, pack_mask
from tests.samples import sample, trace

RUN = "sft-trace"
N = 17  # tokens of the branch: 5 of the prompt, 12 of the answer (tests.samples.trace)
ANSWER = [i >= 6 for i in range(N)]  # the sampled answer tokens


def events() -> list[object]:
    """One rollout scored by grpo (an RL sample) and by sft (cross-entropy on the answer,
    no RL channel), trained in a warm-start batch of sft's sample."""
    rl = sample("r0", N)
    sft = msgspec.structs.replace(
        rl, mask=pack_mask([0] * N), advantages=pack_f32([0.0] * N),
        sft_mask=pack_mask(ANSWER), algorithms=["sft"],
    )  # fmt: skip
    return [
        TraceCompleted(run=RUN, event_id="e-trace", env="reverse-text", request_id="e-task",
                       group_size=1, step=0, trace=trace(RUN, "r0")),
        SamplesScored(run=RUN, event_id="e-sft", algorithm="sft", env="reverse-text",
                      group_id="g0", request_id="e-task", task_index=7, step=0, samples=[sft]),
        SamplesScored(run=RUN, event_id="e-grpo", algorithm="grpo", env="reverse-text",
                      group_id="g0", request_id="e-task", task_index=7, step=0, samples=[rl]),
        BatchAssembled(run=RUN, event_id="e-batch", step=1, phase="sft", samples=[sft],
                       policy_version=0, sources=["e-sft"]),
    ]  # fmt: skip


def test_sft_sample_shows_its_cross_entropy_tokens_not_zero_advantages() -> None:
    chain = trace_chain(events(), "r0")
    answer = chain["messages"][1]["tokens"]  # the assistant message: branch tokens 5..16
    assert [t["sft"] for t in answer] == [{"sft": 1.0 if ANSWER[5 + i] else 0.0} for i in range(12)]
    # the RL channel is grpo's alone: sft's empty one is no column of zeros
    assert all(set(t["advantage"]) == {"grpo"} for t in answer)
    assert answer[1]["advantage"] == {"grpo": 0.5}
    (sft,) = [s for s in chain["forward"]["scored"] if s["algorithm"] == "sft"]
    (grpo,) = [s for s in chain["forward"]["scored"] if s["algorithm"] == "grpo"]
    assert (sft["sft_tokens"], grpo["sft_tokens"]) == ({0: sum(ANSWER)}, {})
    assert chain["forward"]["batches"][0]["phase"] == "sft"


def test_rendered_table_has_a_cross_entropy_column_for_sft() -> None:
    out = io.StringIO()
    render_chain(trace_chain(events(), "r0"), Console(file=out, width=200, highlight=False))
    text = out.getvalue()
    assert "ce sft" in text and "adv grpo" in text and "adv sft" not in text
    assert "scored by sft (e-sft): SFT on {0: 11} tokens (per branch)" in text
    assert "scored by grpo (e-grpo): advantage {0: 0.5}" in text


def test_a_weighted_sft_channel_shows_its_weights() -> None:
    """``ce_weights`` (tool outputs trained as SFT at ``alpha``) win over the 0/1 mask."""
    evs = events()
    scored = evs[1]
    assert isinstance(scored, SamplesScored)
    weighted = msgspec.structs.replace(
        scored.samples[0], ce_weights=pack_f32([0.25 if a else 0.0 for a in ANSWER])
    )
    evs[1] = msgspec.structs.replace(scored, samples=[weighted])
    answer = trace_chain(evs, "r0")["messages"][1]["tokens"]
    assert answer[-1]["sft"] == {"sft": 0.25} and answer[0]["sft"] == {"sft": 0.0}
