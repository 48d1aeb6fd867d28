"""One deterministic, realistic instance of every event type (goldens and round trips),
and a user's working directory (``user_dir``)."""

from __future__ import annotations

from pathlib import Path

import msgspec

from schemas import (
    AlgorithmAttached,
    AlgorithmDetached,
    BatchAssembled,
    Branch,
    DeadLettered,
    EvalCompleted,
    Event,
    Message,
    MetricsReported,
    ObjectRef,
    RunStarted,
    RunStopped,
    Sample,
    SamplesScored,
    SamplingParams,
    TaskRef,
    TaskRequested,
    Trace,
    TraceCompleted,
    TraceError,
    WeightsPublished,
    WeightsStored,
)
from schemas.arrays import pack_f32, pack_i32, pack_mask

TS = 1_700_000_000_000_000_000


def trace(run: str = "golden", rollout: str = "r0", n_tokens: int = 12) -> Trace:
    prompt = Message(
        id=0,
        role="user",
        content="abc",
        token_ids=pack_i32(range(5)),
        sampled=pack_mask([0] * 5),
        logprobs=pack_f32([0.0] * 5),
    )
    answer = Message(
        id=1, role="assistant", content="cba", parent=0,
        token_ids=pack_i32(range(10, 10 + n_tokens)),
        sampled=pack_mask([0] + [1] * (n_tokens - 1)),
        logprobs=pack_f32([0.0] + [-0.5] * (n_tokens - 1)),
        temperature=1.0, policy_version=3, model="policy", finish_reason="stop",
    )  # fmt: skip
    return Trace(
        rollout_id=rollout, env="reverse-text", task=TaskRef(index=7, data={"text": "abc"}),
        group_id="g0", sample_index=0, messages=[prompt, answer], branches=[Branch(messages=[0, 1])],
        reward=0.75, rewards={"lcs": 0.75}, metrics={"len": 3.0}, timings={"generate_s": 0.1},
        errors=[TraceError(kind="none", message="example")] if rollout == "err" else [],
        policy_min=3, policy_max=3, num_turns=1,
    )  # fmt: skip


def sample(rollout: str = "r0", n: int = 17) -> Sample:
    return Sample(
        rollout_id=rollout, branch=0, env="reverse-text", task_index=7, group_id="g0",
        token_ids=pack_i32(range(n)), mask=pack_mask([i > 5 for i in range(n)]),
        logprobs=pack_f32([-0.25] * n), temperatures=pack_f32([1.0] * n),
        advantages=pack_f32([0.5] * n), sft_mask=pack_mask([0] * n), reward=0.75,
        policy_min=3, policy_max=3,
    )  # fmt: skip


def every_event(run: str = "golden") -> list[Event]:
    base = {"run": run, "ts_ns": TS, "producer": "golden-0"}
    weights = ObjectRef(
        kind="object",
        location="weights.v3",
        bucket=f"RLOBJ_{run}",
        size=1234,
        digest="sha256:" + "0" * 64,
    )
    return [
        RunStarted(event_id="e-run-started", config={"seed": 1, "trainer": {"lr": 0.001}}, seed=1, model_path="tiny", initial_weights=weights, **base),
        RunStopped(event_id="e-run-stopped", reason="max_steps", step=40, detail="done", **base),
        TaskRequested(
            event_id="e-task", env="reverse-text", task=TaskRef(index=7, data={"text": "abc"}), group_id="g0",
            group_size=8, sampling=SamplingParams(temperature=0.9, max_completion_tokens=24, stop=["\n"]),
            step=2, policy_version=2, seed=99, max_turns=3, args={"min_len": 3}, **base,
        ),
        TraceCompleted(event_id="e-trace", env="reverse-text", request_id="e-task", group_size=8, step=2, trace=trace(run), causation_id="e-task", **base),
        EvalCompleted(event_id="e-eval", request_id="e-task", env="reverse-text", step=10, task_index=3, rewards=[1.0, 0.5], traces=[trace(run)], **base),
        SamplesScored(
            event_id="e-scored", algorithm="grpo", env="reverse-text", group_id="g0", request_id="e-task",
            task_index=7, step=2, samples=[sample()], rewards=[0.75, 0.25], excluded=1, **base,
        ),
        BatchAssembled(event_id="e-batch", step=3, samples=[sample(), sample("r1")], policy_version=2, sources=["e-scored"], num_tokens=34, dropped_stale=1, skipped_zero_advantage=2, **base),
        WeightsPublished(event_id="e-weights", version=3, step=3, weights=weights, batch_id="e-batch", **base),
        WeightsStored(event_id="e-stored", version=3, step=3, weights=weights, batch_id="e-batch", causation_id="e-weights", **base),
        MetricsReported(event_id="e-metrics", role="trainer", step=3, values={"loss": 0.5, "grad_norm": 1.25}, policy_version=3, **base),
        DeadLettered(
            event_id="e-dead", role="trainer", consumer="trainer", subject=f"rl.{run}.batch.assembled",
            stream_seq=5, deliveries=5, error_type="ValueError", error="boom", payload=b"\x00\x01", headers={"Rl-Schema": "batch_assembled/1"}, **base,
        ),
        AlgorithmAttached(
            event_id="e-attached", algorithm="maxrl2", name="max_rl", options={"eps": 0.5},
            envs=["reverse-text"], shadow=True, from_seq=42, **base,
        ),
        AlgorithmDetached(event_id="e-detached", algorithm="maxrl2", reason="user", **base),
    ]  # fmt: skip


def a_run_log(run: str) -> list[Event]:
    """``every_event`` as one run's log: its dead letter names a message past the log
    (one naming a stored message takes that message out of the lake's tables)."""
    return [
        msgspec.structs.replace(e, stream_seq=10_000) if isinstance(e, DeadLettered) else e
        for e in every_event(run)
    ]


def batch_for(run: str, step: int) -> BatchAssembled:
    """The batch of trainer step ``step``: on the log before the trainer announces
    weights version ``step`` (inference refuses a version no batch made)."""
    batch = next(e for e in every_event(run) if isinstance(e, BatchAssembled))
    return msgspec.structs.replace(batch, step=step, event_id=f"e-batch-{step}")


def user_dir(tmp_path: Path) -> Path:
    """A working directory as a prime-rl user has one: TOML files in ``configs/``, folders
    named like rlbus's packages, and their own env in ``my_env.py``."""
    work = tmp_path / "work"
    (work / "configs").mkdir(parents=True)
    (work / "configs" / "rl.toml").write_text('[model]\nname = "Qwen/Qwen3-0.6B"\n')
    for name in ("schemas", "bus", "roles", "replay"):
        (work / name).mkdir()
        (work / name / "notes.txt").write_text("mine\n")
    word_count = Path(__file__).resolve().parents[1] / "examples" / "word_count_env.py"
    (work / "my_env.py").write_text(word_count.read_text().replace("word-count", "my-word-count"))
    return work
