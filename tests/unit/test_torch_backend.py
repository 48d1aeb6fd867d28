"""Unit tests for the torch backend's decode loop (no NATS): requests join between steps,
rows are answered as they finish, weight swaps wait for live rows, close, load paths.

The engines here serve seeded random weights (``scramble``) with no default stop tokens,
so every completion runs to its budget unless a test asks for a stop: the order in which
results arrive is then fixed by the budgets alone.
"""

from __future__ import annotations

import asyncio
import importlib.util
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.inference.engine import TorchEngine
from roles.inference.torch_backend import BatcherClosed, TorchBackend
from roles.lib.model import serving_dtype
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import Renderer
from roles.lib.model.shared_weights import Layout, WeightsRing
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import WeightsDigestMismatch, digest, state_dict_to_bytes
from schemas import GenerateRequest, GenerateResult, InferenceFailed, SamplingParams, ScoreRequest
from schemas.arrays import f32, pack_i32
from tests.unit import test_engine
from tests.unit.test_engine import MAX_POS, TEXTS, gen, ids, same, scramble

# The engine tests' fixtures: one torch thread, the tiny model's directory.
one_thread = test_engine.one_thread
tiny_dir = test_engine.tiny_dir


@pytest.fixture(scope="module")
def prompts(tiny_dir: Path) -> list[list[int]]:
    renderer = Renderer(load_tokenizer(tiny_dir))
    return [renderer.render_prompt([{"role": "user", "content": t}]) for t in TEXTS]


def make_engine(tiny_dir: Path, seed: int = 1, **kw: Any) -> TorchEngine:
    return TorchEngine(
        scramble(load_model(tiny_dir), seed), load_tokenizer(tiny_dir), stop_token_ids=[], **kw
    )


def count_steps(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch, pace_s: float = 0.0
) -> Callable[[], int]:
    """Count the engine's decode steps (each at least ``pace_s`` long: a row that must
    still decode when something lands); returns the counter's reader."""
    steps = [0]
    step = engine.step

    def counting() -> Any:
        steps[0] += 1
        time.sleep(pace_s)
        return step()

    monkeypatch.setattr(engine, "step", counting)
    return lambda: steps[0]


# Tokens of the row a swap lands in: with each step paced (``count_steps``), it still
# decodes when the swap lands (a 40-token row at full speed had finished, in a full run).
LONG = 160


async def until(cond: Callable[[], bool]) -> None:
    while not cond():
        await asyncio.sleep(0.0005)


async def test_concurrent_requests_start_together_and_get_what_they_get_alone(
    tiny_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Requests sent together are admitted in one round; half of them sent three steps
    later join the running batch; every result equals the request served alone, and
    reports its queue and compute time."""
    engine = make_engine(tiny_dir)
    budgets = [5, 30, 12, 20, 8, 25, 16, 10, 3, 40]
    reqs = [gen(str(i), p, seed=100 + i, temperature=1.0, max_completion_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]  # fmt: skip
    alone = [engine.generate([r])[0] for r in reqs]
    steps = count_steps(engine, monkeypatch)
    backend = TorchBackend(engine, batch_window_ms=2)  # the late half waits 2 ms at most
    first = [asyncio.create_task(backend.generate([r])) for r in reqs[::2]]
    await until(lambda: steps() >= 3)
    rest = [asyncio.create_task(backend.generate([r])) for r in reqs[1::2]]
    done = {res[0].request_id: res[0] for res in await asyncio.gather(*first, *rest)}
    await backend.close()
    stats = backend.loop.stats
    assert stats.sizes[0] == 5 and stats.batches >= 2  # one round for the first five
    assert stats.largest_batch > 5  # the rest decoded beside them
    for a in alone:
        got = done[a.request_id]
        assert same(got, a) and got.policy_version == 0
        assert got.queue_s >= 0 and got.compute_s > 0


async def test_a_finished_row_is_answered_before_a_long_straggler(
    tiny_dir: Path, prompts: list[list[int]]
) -> None:
    """Two rows in one round: the short one's result arrives while the long one decodes
    (and the loop's busy time is counted meanwhile: pool autoscaling reads it)."""
    backend = TorchBackend(make_engine(tiny_dir), batch_window_ms=50)
    long = asyncio.create_task(
        backend.generate([gen("long", prompts[1], max_completion_tokens=36)])
    )
    short = asyncio.create_task(
        backend.generate([gen("short", prompts[2], max_completion_tokens=3)])
    )
    done, _ = await asyncio.wait({long, short}, return_when=asyncio.FIRST_COMPLETED)
    assert done == {short} and not long.done()
    assert backend.stats()["busy_s"] > 0  # counted as the loop runs, not when it stops
    (s,), (lg,) = short.result(), await long
    await backend.close()
    assert backend.loop.stats.batches == 1  # both were admitted together
    assert len(ids(s)) == 3 and len(ids(lg)) == 36 and s.compute_s < lg.compute_s


async def test_a_request_submitted_mid_decode_does_not_wait_for_the_running_rows(
    tiny_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request arriving while a long row decodes is admitted at once: its result, and a
    refusal's, arrive before the long row's, and equal what they get alone."""
    engine = make_engine(tiny_dir)
    long_req = gen("long", prompts[0], temperature=1.0, seed=7, max_completion_tokens=40)
    short_req = gen("short", prompts[4], temperature=1.0, seed=8, max_completion_tokens=4)
    long_alone, short_alone = engine.generate([long_req]), engine.generate([short_req])
    steps = count_steps(engine, monkeypatch)
    backend = TorchBackend(engine, batch_window_ms=0)
    long = asyncio.create_task(backend.generate([long_req]))
    await until(lambda: steps() >= 3)
    short = asyncio.create_task(backend.generate([short_req]))
    refused = asyncio.create_task(backend.generate([gen("bad", [5, 10_000])]))
    (s,), (bad,) = await short, await refused
    assert not long.done()
    (lg,) = await long
    await backend.close()
    assert isinstance(bad, InferenceFailed) and bad.kind == "bad_request"
    assert s.queue_s < lg.compute_s / 2
    assert same(s, short_alone[0]) and same(lg, long_alone[0])
    assert backend.loop.stats.largest_batch == 2


async def test_a_weight_swap_waits_for_live_rows_and_queued_requests_wait_for_it(
    tiny_dir: Path, prompts: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A swap asked mid-decode stops admissions, lands between two steps once the live row
    has finished, and a request queued meanwhile is answered after it by the new weights:
    each result comes from one version, the one it reports."""
    engine = make_engine(tiny_dir)
    data = state_dict_to_bytes(scramble(load_model(tiny_dir), seed=5))
    long_req = gen("long", prompts[1], max_completion_tokens=40)
    queued_req = gen("queued", prompts[2], max_completion_tokens=6)
    (old_long,) = engine.generate([long_req])
    steps = count_steps(engine, monkeypatch)
    backend = TorchBackend(engine, batch_window_ms=0, swap="drain")
    long = asyncio.create_task(backend.generate([long_req]))
    await until(lambda: steps() >= 2)
    swap = asyncio.create_task(backend.load_weights(data, digest(data), version=3))
    await until(lambda: backend.loop._draining > 0)
    queued = asyncio.create_task(backend.generate([queued_req]))
    await asyncio.sleep(0.01)
    assert not swap.done() and not queued.done() and engine.policy_version == 0
    (lg,) = await long
    await swap
    (q,) = await queued
    await backend.close()
    assert lg.policy_version == 0 and same(lg, old_long)
    assert q.policy_version == 3 and backend.policy_version == 3
    fresh = TorchEngine(scramble(load_model(tiny_dir), seed=5), None, stop_token_ids=[])
    assert same(q, fresh.generate([queued_req])[0]) and q.queue_s > 0.01


@pytest.mark.parametrize("via", ["bytes", "ipc"])
async def test_an_in_flight_swap_lands_while_a_row_decodes_and_records_where(
    tiny_dir: Path,
    prompts: list[list[int]],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    via: str,
) -> None:
    """``inference.swap = "in_flight"``: a swap asked mid-decode lands between two steps
    while the row goes on; its tokens before the swap are the old weights' (equal to a run
    without the swap), ``version_spans`` says from which token the new version sampled,
    and a request after it is answered as a fresh engine with the new weights would
    (every kept prefix forgotten, the live row's too)."""
    engine = make_engine(tiny_dir)
    new = scramble(load_model(tiny_dir), seed=5)
    long_req = gen("long", prompts[1], max_completion_tokens=LONG)
    (old_long,) = engine.generate([long_req])
    # The new version made ready first: what lands mid-decode is the swap alone. Each
    # step paced at 5 ms, so the row (LONG steps) outlasts the swap on a busy machine.
    ring = WeightsRing.create(
        Layout.of(new.state_dict()), torch.float32, torch.device("cpu"), tmp_path
    )
    shared, data = ring.write(3, new.state_dict()), state_dict_to_bytes(new)
    steps = count_steps(engine, monkeypatch, pace_s=0.005)
    backend = TorchBackend(engine, batch_window_ms=0)
    long = asyncio.create_task(backend.generate([long_req]))
    await until(lambda: steps() >= 5)
    if via == "ipc":
        paused = await backend.load_shared(shared, version=3)
    else:
        paused = await backend.load_weights(data, digest(data), version=3)
    assert not long.done() and engine.policy_version == 3 and paused > 0
    (lg,) = await long
    ((at, version),) = lg.version_spans
    assert version == 3 and lg.policy_version == 0 and lg.versions() == [0, 3]
    assert 5 <= at < LONG
    assert ids(lg)[:at] == ids(old_long)[:at]
    assert f32(lg.logprobs)[:at].tolist() == f32(old_long.logprobs)[:at].tolist()
    (after,) = await backend.generate([long_req])  # its old prompt is not reused
    await backend.close()
    fresh = TorchEngine(scramble(load_model(tiny_dir), seed=5), None, stop_token_ids=[])
    assert same(after, fresh.generate([long_req])[0]) and not after.version_spans


async def test_bad_weights_are_refused_and_the_old_ones_keep_serving(tiny_dir: Path) -> None:
    """A digest mismatch or a state dict of another shape never touches the served model."""
    backend = TorchBackend.from_path(tiny_dir, device="cpu")
    before = {k: v.clone() for k, v in backend.engine.model.state_dict().items()}
    data = state_dict_to_bytes(backend.engine.model)
    with pytest.raises(WeightsDigestMismatch):
        await backend.load_weights(data, "sha256:" + "0" * 64, version=1)
    other = load_model(build_tiny_model(Path(str(tiny_dir) + "-wide"), hidden_size=64, max_position_embeddings=MAX_POS))  # fmt: skip
    wrong_shape = state_dict_to_bytes(other)
    with pytest.raises(ValueError, match="do not fit"):
        await backend.load_weights(wrong_shape, digest(wrong_shape), version=1)
    await backend.close()
    assert backend.policy_version == 0
    after = backend.engine.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


async def test_scores_stop_strings_and_refusals_answer_as_the_engine_does(
    tiny_dir: Path, prompts: list[list[int]]
) -> None:
    """Through the loop, stop tokens and strings end rows, bad requests are refused alone,
    a zero budget answers empty, and scores run between decode steps: all exactly as the
    engine answers them directly; the counters add up."""
    engine = make_engine(tiny_dir)
    free = ids(
        engine.generate([gen("f", prompts[2], temperature=0.0, max_completion_tokens=16)])[0]
    )
    stop_text = engine.tokenizer.decode(free[4:6])  # type: ignore[union-attr]
    cut = free.index(free[3]) + 1
    reqs: list[Any] = [
        gen("long", prompts[1], max_completion_tokens=30),
        GenerateRequest(
            request_id="str",
            prompt_ids=pack_i32(prompts[2]),
            sampling=SamplingParams(temperature=0.0, max_completion_tokens=16, stop=[stop_text]),
        ),  # fmt: skip
        gen("tok", prompts[2], temperature=0.0, max_completion_tokens=16, stop=[free[3]]),
        gen("id", [5, 10_000]),
        gen("p", [5, 6], temperature=1.0, top_p=0.0),
        gen("ctx", [10] * MAX_POS),
        gen("zero", prompts[3], max_completion_tokens=0),
    ]
    score = ScoreRequest(request_id="s", token_ids=pack_i32(prompts[1] + free), start=4)
    expected = engine.run_batch([*reqs, score])
    backend = TorchBackend(engine, batch_window_ms=0)
    before = backend.stats()
    got = await asyncio.gather(backend.generate(reqs), backend.score([score]))
    await backend.close()
    stats = {k: v - before[k] for k, v in backend.stats().items()}
    for e, g in zip(expected, [*got[0], *got[1]], strict=True):
        assert type(g) is type(e) and g.request_id == e.request_id
        if isinstance(e, InferenceFailed):
            assert g.kind == e.kind
        elif isinstance(e, GenerateResult):
            assert same(g, e)
        else:
            assert f32(g.logprobs).tolist() == f32(e.logprobs).tolist()
    by_id = {g.request_id: g for g in got[0]}
    assert by_id["str"].finish_reason == "stop" and by_id["tok"].finish_reason == "stop"
    assert ids(by_id["tok"]) == free[:cut] and ids(by_id["zero"]) == []
    assert stats["failed_requests"] == 3 and stats["score_requests"] == 1
    assert stats["busy_s"] > 0 and stats["batched_items"] == len(reqs) + 1


async def test_close_answers_queued_work_then_refuses(
    tiny_dir: Path, prompts: list[list[int]]
) -> None:
    """close() finishes every queued request (more than there are slots), then refuses."""
    backend = TorchBackend(make_engine(tiny_dir, max_batch_size=4), batch_window_ms=0)
    reqs = [gen(str(i), prompts[i], max_completion_tokens=4 + i) for i in range(9)]
    tasks = [asyncio.create_task(backend.generate([r])) for r in reqs]
    await asyncio.sleep(0)  # every request is queued
    await backend.close()
    assert [len(ids(t.result()[0])) for t in tasks] == [4 + i for i in range(9)]
    with pytest.raises(BatcherClosed):
        await backend.generate(reqs[:1])


async def test_a_cancelled_request_frees_its_slot(tiny_dir: Path, prompts: list[list[int]]) -> None:
    """A caller that gives up (a timeout) leaves: its row is dropped at the next step and
    its slot serves the next request."""
    backend = TorchBackend(make_engine(tiny_dir, max_batch_size=4), batch_window_ms=0)
    gone = asyncio.create_task(
        backend.generate([gen("gone", prompts[0], max_completion_tokens=50)])
    )
    await until(lambda: backend.engine.live == 1)
    gone.cancel()
    await until(lambda: backend.engine.live == 0)
    (r,) = await backend.generate([gen("next", prompts[1], max_completion_tokens=5)])
    await backend.close()
    assert len(ids(r)) == 5 and backend.engine.free == 4


def test_vllm_backend_without_vllm_names_the_extra(tmp_path: Path) -> None:
    """Selecting the vllm backend where vLLM is absent fails with the extra to install."""
    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from roles.inference.vllm_backend import VllmBackend  # importable without vllm

    with pytest.raises(ImportError, match=r"rlbus\[vllm\]"):
        VllmBackend(tmp_path)


# -- the CUDA path, checked on the CPU ------------------------------------------------------


def test_serving_dtype_is_bf16_on_cuda_unless_fp16_and_unchanged_on_cpu() -> None:
    assert [serving_dtype(d, "cpu") for d in ("float32", "bfloat16", "float16")] == [
        "float32", "bfloat16", "float16",
    ]  # fmt: skip
    assert [serving_dtype(d, "cuda:1") for d in ("float32", "bfloat16", "float16")] == [
        "bfloat16", "bfloat16", "float16",
    ]  # fmt: skip
    # inference.dtype, when it names one, wins on any device
    assert serving_dtype("float32", "cuda", "float32") == "float32"
    assert serving_dtype("float32", "cpu", "bfloat16") == "bfloat16"


@pytest.mark.parametrize(
    ("device", "dtype", "cap"),
    [
        ("cuda", "bfloat16", [(0.45, None)]),
        ("cuda:1", "float16", [(0.3, 1)]),
        ("cpu", "float32", []),
    ],
)
def test_from_path_serves_in_the_serving_dtype_under_the_memory_cap(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch, device: str, dtype: str, cap: list[Any]
) -> None:
    """On CUDA the allocator is capped before the model loads, in bf16 (fp16 if asked);
    on the CPU neither happens. The model itself is loaded on the CPU here."""
    from roles.inference import engine as engine_module

    calls: list[Any] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d))
    )

    def fake_load(path: Any, *, dtype: str, device: str, local_files_only: bool) -> Any:
        calls.append({"dtype": dtype, "device": device})
        return load_model(path, dtype=dtype)

    monkeypatch.setattr(engine_module, "load_model", fake_load)
    asked = "float16" if device == "cuda:1" else "float32"
    fraction = 0.3 if device == "cuda:1" else 0.45
    engine = TorchEngine.from_path(
        tiny_dir, device=device, dtype=asked, gpu_memory_fraction=fraction, kv_cache_gb=0.1
    )
    assert calls == [*cap, {"dtype": dtype, "device": device}]
    assert next(engine.model.parameters()).dtype == getattr(torch, dtype)
