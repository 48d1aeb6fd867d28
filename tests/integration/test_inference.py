"""The inference role against a real nats-server: batching, replicas, weights, failures."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import torch
from structlog.testing import capture_logs

from bus import codec
from bus.registry import list_roles
from bus.runtime import Bus, BusSettings
from bus.server import EmbeddedServer
from bus.subjects import Topic, infer_subject, subject
from configs import ConfigError, RunConfig, load_config
from roles.inference.role import InferenceRole, resolve_served_model
from roles.inference.weights_io import fetch_weights, weights_gone
from roles.lib.clients import InferenceClient
from roles.lib.model.loading import load_model
from roles.lib.model.shared_weights import Layout, WeightsRing
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import bytes_to_state_dict, digest, state_dict_to_bytes
from roles.runtime.role import serve_role
from schemas import (
    GenerateResult,
    InferenceFailed,
    MetricsReported,
    ObjectRef,
    SamplingParams,
    ScoreResult,
    WeightsPublished,
    WeightsStored,
)
from schemas.arrays import f32, i32
from tests.samples import batch_for

pytestmark = pytest.mark.nats

GREEDY = SamplingParams(temperature=0.0, max_completion_tokens=8)
PROMPT = [5, 40, 41, 42, 8, 6]  # <|user|> + 3 chars + <|end|><|assistant|>


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", seed=0)


@pytest.fixture(scope="module")
def perturbed_weights(tiny_path: Path) -> bytes:
    """The tiny model with every matrix re-drawn (seeded): greedy outputs change."""
    model = load_model(tiny_path)
    g = torch.Generator().manual_seed(123)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[1] ** 0.5)
    return state_dict_to_bytes(model)


def _cfg(tiny_path: Path, *extra: str) -> RunConfig:
    return load_config(
        "smoke",
        [f"model.path={tiny_path}", "inference.device=cpu", "inference.batch_window_ms=30", *extra],
    )


@contextlib.asynccontextmanager
async def running_role(
    server: EmbeddedServer,
    run: str,
    cfg: RunConfig,
    run_dir: Path,
    name: str,
    model: str = "policy",
) -> AsyncIterator[InferenceRole]:
    """One replica served in-process (its own connection, as a real process would have)."""
    rbus = await Bus.connect(server.url, run=run, producer=name, settings=BusSettings())
    role = InferenceRole(
        rbus, name, cfg, model=model, run_dir=run_dir, metrics_interval_s=0.5,
        heartbeat_interval_s=0.5,
    )  # fmt: skip
    task = asyncio.create_task(serve_role(role, install_signals=False))
    ready = asyncio.create_task(role.ready.wait())
    await asyncio.wait({task, ready}, timeout=60, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        ready.cancel()
        task.result()  # raises what setup raised
    assert role.ready.is_set(), "inference role did not become ready"
    try:
        yield role
    finally:
        role.request_stop()
        await asyncio.wait_for(task, 30)


async def _generate(
    client: InferenceClient, rid: str, prompt: list[int] = PROMPT
) -> GenerateResult:
    res = await client.generate("policy", rid, prompt, GREEDY)
    assert isinstance(res, GenerateResult), res
    return res


async def _publish_weights(bus: Bus, version: int, data: bytes, digest: str | None = None) -> None:
    name = f"weights.v{version}"
    real = await bus.objects.put(name, data)
    ref = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(data), digest=digest or real)  # fmt: skip
    await bus.publish(batch_for(bus.run, version))  # as a trainer step follows its batch
    await bus.publish(WeightsPublished(run=bus.run, version=version, step=version, weights=ref))


async def _until(predicate, timeout_s: float = 20.0) -> None:  # noqa: ANN001
    async with asyncio.timeout(timeout_s):
        while not await predicate():
            await asyncio.sleep(0.05)


async def test_concurrent_requests_are_batched_across_two_replicas(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path
) -> None:
    """Concurrent requests are all answered, in batches >1, by both replicas of the group."""
    cfg = _cfg(tiny_path)
    client = InferenceClient(bus, timeout_s=30)
    async with (
        running_role(nats_server, bus.run, cfg, tmp_path, "inf-a") as a,
        running_role(nats_server, bus.run, cfg, tmp_path, "inf-b") as b,
    ):
        prompts = [PROMPT[:-1] + [40 + i % 7] + PROMPT[-1:] for i in range(40)]
        results: list[GenerateResult] = []
        # Bursts of 40 until both replicas served some: the server picks a queue member at
        # random per message, and CI once saw a whole burst land on one replica.
        for wave in range(3):
            results += await asyncio.gather(
                *(_generate(client, f"r{wave}.{i}", p) for i, p in enumerate(prompts))
            )
            stats = [a.backend.stats(), b.backend.stats()]  # type: ignore[union-attr]
            if all(s["generate_requests"] > 0 for s in stats):
                break
        score = await client.score("policy", "s", PROMPT, start=2)
    n = len(results)
    expected = [f"r{w}.{i}" for w in range(n // 40) for i in range(40)]
    assert sorted(r.request_id for r in results) == sorted(expected)
    assert all(r.policy_version == 0 and len(i32(r.completion_ids)) >= 1 for r in results)
    assert all(len(f32(r.logprobs)) == len(i32(r.completion_ids)) for r in results)
    assert isinstance(score, ScoreResult) and len(f32(score.logprobs)) == len(PROMPT) - 2
    assert sum(s["generate_requests"] for s in stats) == n
    assert all(s["generate_requests"] > 0 for s in stats), stats  # both replicas served
    assert max(s["largest_batch"] for s in stats) > 1  # requests were batched


async def test_weights_follow_published_events_and_bad_ones_are_refused(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """weights.published mid-stream changes version and outputs; a bad digest changes nothing."""
    cfg = _cfg(tiny_path)
    client = InferenceClient(bus, timeout_s=30)
    with capture_logs() as logs:
        async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-a") as a:
            before = await _generate(client, "v0")
            assert before.policy_version == 0

            await _publish_weights(bus, 1, perturbed_weights)

            async def on_v1() -> bool:
                return (await _generate(client, "poll")).policy_version == 1

            await _until(on_v1)
            after = await _generate(client, "v1")
            assert after.completion_ids != before.completion_ids

            # A replica started now loads the newest weights before it answers anything.
            async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-b") as b:
                assert b.backend is not None and b.backend.policy_version == 1

                await _publish_weights(bus, 2, perturbed_weights[::-1], digest="sha256:" + "0" * 64)

                async def both_refused() -> bool:
                    return a.weights_rejected == 1 and b.weights_rejected == 1

                await _until(both_refused)
                still = await _generate(client, "v1-again")
            assert still.policy_version == 1 and still.completion_ids == after.completion_ids

            async def metrics_published() -> bool:
                try:
                    msg = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.METRICS_REPORTED, "inference"))  # fmt: skip
                except Exception:  # noqa: BLE001 - not published yet
                    return False
                m = await bus.decode_msg(msg, [MetricsReported])
                return m.role == "inference" and m.values.get("tokens_per_s", 0) > 0

            await _until(metrics_published)
    rejected = [e for e in logs if e["event"] == "weights.rejected"]
    assert rejected and all(e["log_level"] == "error" and e["version"] == 2 for e in rejected)
    assert "sha256:" + "0" * 64 in rejected[0]["error"]


async def test_a_restarted_replica_loads_the_newest_good_weights_past_bad_announcements(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """Newest first on the log: garbage, an event of another type, a wrong digest; before
    them the good version 1. A replica starting now serves version 1, not the initial
    weights (which would make every rollout stale, a livelock)."""
    await _publish_weights(bus, 1, perturbed_weights)
    await _publish_weights(bus, 2, perturbed_weights[::-1], digest="sha256:" + "0" * 64)
    weights_subject = subject(bus.run, Topic.WEIGHTS_PUBLISHED)
    metrics = MetricsReported(run=bus.run, role="trainer", step=3, values={"loss": 1.0})
    await bus.js.publish(weights_subject, codec.encode(metrics), headers=codec.headers_for(metrics))
    await bus.js.publish(weights_subject, b"\xc1 garbage", headers={"Nats-Msg-Id": "junk"})
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, _cfg(tiny_path), tmp_path, "inf-a") as a:
        assert a.backend is not None and a.backend.policy_version == 1
        assert a.weights_rejected == 1  # version 2, its digest
        assert (await _generate(client, "after-restart")).policy_version == 1


async def test_a_version_no_batch_made_is_refused_and_later_versions_still_load(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """An announcement of version 1e9 naming real weights and their real digest (a buggy
    trainer's) is refused: no batch made it. Served, it would shadow every real version
    after it; refused, the real version 1 still loads."""
    name = "weights.v0"
    tiny = (tiny_path / "model.safetensors").read_bytes()
    real = await bus.objects.put(name, tiny)
    ref = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket, size=len(tiny), digest=real)  # fmt: skip
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, _cfg(tiny_path), tmp_path, "inf-a") as a:
        forged = WeightsPublished(run=bus.run, version=10**9, step=10**9, weights=ref)
        await bus.publish(forged)
        await _until(_when(lambda: a.weights_rejected == 1))
        assert "no trainer step made it" in (a.last_weights_error or "")
        await _publish_weights(bus, 1, perturbed_weights)

        async def on_v1() -> bool:
            return (await _generate(client, "poll")).policy_version == 1

        await _until(on_v1)


async def test_bad_and_too_long_requests_get_typed_failures(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path
) -> None:
    """A too-long prompt answers context_too_long; undecodable bytes answer bad_request."""
    cfg = _cfg(tiny_path)
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-a") as role:
        too_long = await client.generate("policy", "long", [10] * 300, GREEDY)
        subj = infer_subject(bus.run, "policy")
        garbage = await bus.nc.request(subj, b"\x00not msgpack", timeout=10)
        wrong = msgspec.msgpack.encode({"type": "generate/1", "request_id": "w", "prompt_ids": 5})
        wrong_type = await bus.nc.request(subj, wrong, timeout=10)
        ok = await _generate(client, "ok")
        heartbeats = await list_roles(bus.js, bus.run)
    assert isinstance(too_long, InferenceFailed) and too_long.kind == "context_too_long"
    replies = [codec.decode(m.data, (InferenceFailed,)) for m in (garbage, wrong_type)]
    assert [r.kind for r in replies] == ["bad_request", "bad_request"]
    assert replies[1].request_id == "w"
    assert ok.policy_version == 0
    assert role.backend is not None
    stats = role.backend.stats()
    assert (stats["generate_requests"], stats["failed_requests"]) == (1, 1)
    (hb,) = [h for h in heartbeats if h.role == "inference"]
    assert hb.policy_version == 0


async def test_a_policy_snapshot_stays_at_its_version(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """`policy_version = 1`: a snapshot started after v2 was announced finds v1 on the log
    and serves it; v3 moves the policy replica, never the snapshot."""
    cfg = load_config("smoke", [f"model.path={tiny_path}", "inference.device=cpu",
                                "orchestrator.models.snap.policy_version=1"])  # fmt: skip
    await _publish_weights(bus, 1, perturbed_weights)
    await _publish_weights(bus, 2, perturbed_weights[::-1])
    async with (
        running_role(nats_server, bus.run, cfg, tmp_path, "snap-0", model="snap") as snap,
        running_role(nats_server, bus.run, cfg, tmp_path, "pol-0") as policy,
    ):
        assert snap.backend is not None and snap.backend.policy_version == 1
        await _publish_weights(bus, 3, perturbed_weights)

        async def policy_on_v3() -> bool:
            return policy.backend is not None and policy.backend.policy_version == 3

        await _until(policy_on_v3)
        await asyncio.sleep(0.2)  # the snapshot got v3 on its own follower by now
        assert snap.backend.policy_version == 1 and snap.weights_rejected == 0


def test_served_model_comes_from_the_config(tiny_path: Path) -> None:
    """policy follows weights at model.path; an orchestrator.models key is frozen; others fail."""
    cfg = load_config(
        "smoke", [f"model.path={tiny_path}", "orchestrator.models.ref.path=/models/ref"]
    )
    policy = resolve_served_model(cfg, "policy")
    assert (policy.path, policy.follows_weights) == (str(tiny_path), True)
    ref = resolve_served_model(cfg, "ref")
    assert (ref.path, ref.subject_model, ref.follows_weights) == ("/models/ref", "ref", False)
    teacher = resolve_served_model(cfg, "teacher")  # no path: the frozen base weights
    assert (teacher.path, teacher.follows_weights) == (str(tiny_path), False)
    with pytest.raises(ConfigError, match="orchestrator.models"):
        resolve_served_model(cfg, "nobody")


@pytest.fixture
def shm_file(tmp_path: Path) -> Iterator[Path]:
    """A file under /dev/shm (tmp_path where there is none), removed afterwards."""
    shm = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else tmp_path
    fd, name = tempfile.mkstemp(dir=shm, prefix="rlbus-test-weights-")
    os.close(fd)
    yield Path(name)
    Path(name).unlink(missing_ok=True)


async def test_weights_in_a_shm_file_load_like_a_path_and_report_their_lag(
    bus: Bus,
    nats_server: EmbeddedServer,
    tiny_path: Path,
    tmp_path: Path,
    perturbed_weights: bytes,
    shm_file: Path,
) -> None:
    """kind "shm" (a file the trainer wrote under /dev/shm) is read like "path"; the swap's
    lag, published -> serving, is measured from the announcement's ts_ns and reported."""
    await asyncio.to_thread(shm_file.write_bytes, perturbed_weights)
    ref = ObjectRef(kind="shm", location=str(shm_file), size=len(perturbed_weights), digest=digest(perturbed_weights))  # fmt: skip
    client = InferenceClient(bus, timeout_s=30)
    announced = time.time_ns() - 2_000_000_000  # as if the trainer announced it 2 s ago
    assert await fetch_weights(bus, ref) == perturbed_weights
    assert not await weights_gone(bus, ref)
    async with running_role(nats_server, bus.run, _cfg(tiny_path), tmp_path, "inf-shm") as role:
        event = WeightsPublished(run=bus.run, version=1, step=1, weights=ref, ts_ns=announced)
        await bus.publish(batch_for(bus.run, 1))
        await bus.publish(event)

        async def reported() -> bool:  # traffic, so that a report is due
            await _generate(client, "traffic")
            try:
                msg = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.METRICS_REPORTED, "inference"))  # fmt: skip
            except Exception:  # noqa: BLE001 - not published yet
                return False
            m = await bus.decode_msg(msg, [MetricsReported])
            return "weights_lag_s" in m.values and m.policy_version == 1

        await _until(reported)
        lag = role.weights_lag_s
        msg = await bus.js.get_last_msg(bus.stream, subject(bus.run, Topic.METRICS_REPORTED, "inference"))  # fmt: skip
        values = (await bus.decode_msg(msg, [MetricsReported])).values
    await asyncio.to_thread(shm_file.unlink)
    assert await weights_gone(bus, ref)
    assert lag is not None and 2.0 <= lag < 30.0
    assert values["weights_lag_s"] == lag


async def test_weights_shared_on_the_device_load_from_the_ring_or_fall_back_to_stored_bytes(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """``trainer.weights_via = "ipc"`` on the CPU (the ring is a shared file): version 1,
    only in the ring, is copied out of it and served; version 4's slot was overwritten
    after its announcement (the trainer ran a lap ahead), so its device digest fails and
    the stored bytes are loaded instead; version 7, only in the ring and overwritten too,
    is refused and the served weights stay (nothing newer is announced, and the trainer
    stores only every 13th version); version 13, only in the ring and overwritten, waits
    for the bytes its ``weights.stored`` names, published after it, and loads them."""
    trainer = load_model(tiny_path)
    trainer.load_state_dict(bytes_to_state_dict(perturbed_weights), strict=False)
    other = load_model(tiny_path)
    ring = WeightsRing.create(Layout.of(trainer.state_dict()), torch.float32, torch.device("cpu"), tmp_path / "ring")  # fmt: skip

    async def announce(version: int, weights: ObjectRef, device: ObjectRef) -> None:
        await bus.publish(batch_for(bus.run, version))
        await bus.publish(WeightsPublished(run=bus.run, version=version, step=version,
                                           weights=weights, device=device))  # fmt: skip

    client = InferenceClient(bus, timeout_s=30)
    with capture_logs() as logs:
        # The run's trainer shares versions on the device and stores every 13th after it.
        ipc = _cfg(
            tiny_path, "trainer.weights_via=ipc", "trainer.store_weights_every=13", "max_steps=100"
        )
        async with running_role(nats_server, bus.run, ipc, tmp_path, "inf-ipc") as role:
            backend = role.backend
            assert backend is not None
            via: dict[int, str] = {}  # version -> the load that served it
            for name, kind in (("load_shared", "ipc"), ("load_weights", "bytes")):
                load = getattr(backend, name)

                async def loaded(*args: object, _load=load, _kind=kind) -> float:  # noqa: ANN001
                    paused = await _load(*args)
                    via[int(args[-1])] = _kind  # type: ignore[call-overload]
                    return float(paused)

                setattr(backend, name, loaded)
            v1 = ring.write(1, trainer.state_dict())
            await announce(1, v1, v1)
            await _until(_when(lambda: role.backend.policy_version == 1))
            served = role.backend.engine.model.state_dict()  # type: ignore[attr-defined]
            assert all(torch.equal(served[k], t) for k, t in trainer.state_dict().items())

            v4 = ring.write(4, other.state_dict())
            ring.write(7, trainer.state_dict())  # the same slot: v4's bytes are gone from it
            name = "weights.v4"
            stored = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket,
                               digest=await bus.objects.put(name, state_dict_to_bytes(other)))  # fmt: skip
            await announce(4, stored, v4)
            await _until(_when(lambda: role.backend.policy_version == 4))
            served = role.backend.engine.model.state_dict()  # type: ignore[attr-defined]
            assert all(torch.equal(served[k], t) for k, t in other.state_dict().items())

            v7 = ring.write(7, trainer.state_dict())
            ring.write(10, other.state_dict())
            await announce(7, v7, v7)
            await _until(_when(lambda: role.weights_rejected == 1))
            assert (await _generate(client, "after")).policy_version == 4

            # Announced on the device only, its slot overwritten; a version the trainer
            # stores after its announcement: the replica waits for those bytes
            # (weights.stored, seconds later) and loads them.
            v13 = ring.write(13, trainer.state_dict())
            ring.write(16, other.state_dict())
            await announce(13, v13, v13)
            await _until(_when(lambda: 13 in role._awaiting_bytes))
            assert role.backend.policy_version == 4 and role.weights_rejected == 1
            name = "weights.v13"
            stored = ObjectRef(kind="object", location=name, bucket=bus.objects.bucket,
                               digest=await bus.objects.put(name, state_dict_to_bytes(trainer)))  # fmt: skip
            await bus.publish(WeightsStored(run=bus.run, version=13, step=13, weights=stored))
            await _until(_when(lambda: role.backend.policy_version == 13))
            served = role.backend.engine.model.state_dict()  # type: ignore[attr-defined]
            assert all(torch.equal(served[k], t) for k, t in trainer.state_dict().items())
    assert via == {1: "ipc", 4: "bytes", 13: "bytes"}
    failed = [e for e in logs if e["event"] == "weights.device_failed"]
    assert [e["version"] for e in failed] == [4, 13]
    assert [e["version"] for e in logs if e["event"] == "weights.awaiting_bytes"] == [13]
    assert all("digest mismatch" in e["error"] for e in failed)
    (rejected,) = [e for e in logs if e["event"] == "weights.rejected"]
    assert rejected["version"] == 7 and "digest mismatch" in rejected["error"]
    ring.close()


# -- eval pinning --------------------------------------------------------------------------


def _when(check):  # noqa: ANN001, ANN202 - a sync check as an _until predicate
    async def predicate() -> bool:
        return bool(check())

    return predicate


async def _pinned_stream(
    client: InferenceClient, pin: int, stop: asyncio.Event, out: list[tuple[float, int]]
) -> None:
    """Pinned requests one after another (an eval's turns) until ``stop``: (reply time,
    version) of each."""
    i = 0
    while not stop.is_set():
        res = await client.generate("policy", f"pin{pin}.{i}", PROMPT, GREEDY, pin_version=pin)
        assert isinstance(res, GenerateResult), res
        out.append((time.monotonic(), res.policy_version))
        i += 1


async def test_pinned_requests_keep_their_weights_until_done_then_the_swap_happens(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """Weights v1 announced while requests pinned to v0 run: every pinned request (and any
    other meanwhile) is answered by v0, the swap lands `eval_pin_grace_s` after the last
    pinned one ended; a request pinned to v2 while v1 serves waits for v2's swap."""
    grace = 0.5
    cfg = load_config("smoke", [f"model.path={tiny_path}", "inference.device=cpu",
                                f"inference.eval_pin_grace_s={grace}",
                                "inference.eval_pin_max_s=15",
                                "orchestrator.eval.interval=0"])  # no eval due: no hold of its own  # fmt: skip
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-pin") as role:
        stop, answers = asyncio.Event(), []
        stream = asyncio.create_task(_pinned_stream(client, 0, stop, answers))
        await _until(_when(lambda: len(answers) >= 2))
        await _publish_weights(bus, 1, perturbed_weights)
        await asyncio.sleep(1.5)  # v1 is fetched and ready long before this
        during = await _generate(client, "unpinned")
        stop.set()
        await stream
        ended = answers[-1][0]

        async def on_v1() -> bool:
            return (await _generate(client, "poll")).policy_version == 1

        await _until(on_v1)
        swapped = time.monotonic()
        assert {v for _, v in answers} == {0} and during.policy_version == 0
        assert swapped - ended >= grace - 0.1, (swapped - ended, grace)

        newer = asyncio.create_task(
            client.generate("policy", "pin2", PROMPT, GREEDY, pin_version=2)
        )
        await asyncio.sleep(0.5)
        assert not newer.done()  # waits for the version it asks at
        await _publish_weights(bus, 2, perturbed_weights)
        result = await newer
        assert isinstance(result, GenerateResult) and result.policy_version == 2
        assert role.backend is not None and role.backend.policy_version == 2


async def test_the_version_an_eval_waits_for_is_loaded_though_newer_ones_came(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """v2 and v3 announced while a hold keeps v0 (the swap to v1 waits): a request pinned
    to v2 gets v2, loaded before v3 (which the replica serves afterwards), where without
    pins the replica would skip from v1 to the newest."""
    cfg = load_config("smoke", [f"model.path={tiny_path}", "inference.device=cpu",
                                "inference.eval_pin_grace_s=0.3", "inference.eval_pin_max_s=15"])  # fmt: skip
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-pin-wanted") as role:
        stop, answers = asyncio.Event(), []
        stream = asyncio.create_task(_pinned_stream(client, 0, stop, answers))
        await _until(_when(lambda: len(answers) >= 2))
        for version in (1, 2, 3):
            await _publish_weights(bus, version, perturbed_weights)
            await asyncio.sleep(0.3)
        at_v2 = asyncio.create_task(
            client.generate("policy", "pin-v2", PROMPT, GREEDY, pin_version=2)
        )
        await asyncio.sleep(0.3)
        stop.set()
        await stream
        result = await at_v2
        assert {v for _, v in answers} == {0}
        assert isinstance(result, GenerateResult) and result.policy_version == 2
        await _until(_when(lambda: role.backend is not None and role.backend.policy_version == 3))


async def test_a_pin_never_holds_weights_longer_than_eval_pin_max_s(
    bus: Bus, nats_server: EmbeddedServer, tiny_path: Path, tmp_path: Path, perturbed_weights: bytes
) -> None:
    """Pinned requests that never stop hold v1 back for `eval_pin_max_s` (1 s), not for
    ever: the swap then happens mid-stream, and later pinned replies say v1."""
    cfg = load_config("smoke", [f"model.path={tiny_path}", "inference.device=cpu",
                                "inference.eval_pin_grace_s=5", "inference.eval_pin_max_s=1"])  # fmt: skip
    client = InferenceClient(bus, timeout_s=30)
    async with running_role(nats_server, bus.run, cfg, tmp_path, "inf-pin-max"):
        stop, answers = asyncio.Event(), []
        stream = asyncio.create_task(_pinned_stream(client, 0, stop, answers))
        await _until(_when(lambda: len(answers) >= 2))
        published = time.monotonic()
        await _publish_weights(bus, 1, perturbed_weights)
        await _until(_when(lambda: answers[-1][1] == 1), timeout_s=10)
        first_v1 = next(t for t, v in answers if v == 1)
        stop.set()
        await stream
    assert 0.9 <= first_v1 - published <= 4.0, first_v1 - published
    assert [v for _, v in answers] == sorted(v for _, v in answers)  # v0 then v1, no return


async def test_pin_hold_waits_for_grace_and_bounds_a_wait_for_a_newer_version() -> None:
    """PinHold alone: `clear` returns at once with nothing pinned, after the grace once the
    last pinned request ended; `reach` gives up after max_s, and at once for that version
    afterwards."""
    from roles.inference.pinning import PinHold

    hold = PinHold(grace_s=0.2, max_s=0.4)
    assert await hold.clear(0) < 0.05
    with hold.pinned(0):
        assert hold.running(0) == 1
    assert 0.15 <= await hold.clear(0) <= 0.35
    t = time.monotonic()
    assert not await hold.reach(3, lambda: 1)
    assert 0.35 <= time.monotonic() - t <= 0.6
    assert not await hold.reach(3, lambda: 1)  # already waited its bound
    assert await hold.reach(1, lambda: 1)


async def test_pin_hold_waits_for_a_due_eval_and_gives_up_on_a_refused_version() -> None:
    """A version whose eval is due is held until its first pinned request has come and
    gone (its eval requests may arrive after the next version is announced), at most
    expect_s for that first one; a request waiting for a version the replica refused is
    released at once."""
    from roles.inference.pinning import PinHold

    hold = PinHold(grace_s=0.1, max_s=5.0)
    t = time.monotonic()
    assert 0.25 <= await hold.clear(4, expect_s=0.3) <= 0.6  # no eval request came
    clearing = asyncio.create_task(hold.clear(5, expect_s=3.0))
    await asyncio.sleep(0.1)
    assert not clearing.done()  # waiting for the eval's first request
    with hold.pinned(5):
        await asyncio.sleep(0.05)
    assert 0.1 <= await clearing <= 0.4  # then the grace after it
    waiting = asyncio.create_task(hold.reach(7, lambda: 5))
    await asyncio.sleep(0.05)
    hold.refused(7)
    assert await waiting is False
    assert time.monotonic() - t < 1.5
