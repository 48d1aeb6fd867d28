"""Unit tests for the torch inference backend (no NATS): padding, logprobs, stops, weights.

The tiny model as built (std 0.02 init) is almost uniform and greedily repeats one
token, which would make padding bugs invisible; the engine here gets seeded large
random weights instead, so completions depend on every prompt token.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from roles.inference import sampling
from roles.inference.backend import serving_dtype
from roles.inference.torch_backend import TorchBackend, TorchEngine
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import Renderer
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import WeightsDigestMismatch, digest, state_dict_to_bytes
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
)
from schemas.arrays import f32, i32, pack_i32

MAX_POS = 64


def _scramble(model: Any, seed: int, gain: float = 2.0) -> None:
    """Replace every matrix by seeded N(0, gain^2 / fan_in): a peaky, prompt-sensitive model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[1] ** 0.5)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", seed=0, max_position_embeddings=MAX_POS
    )


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> TorchEngine:
    model = load_model(tiny_dir)
    _scramble(model, seed=1)
    return TorchEngine(model, load_tokenizer(tiny_dir))


@pytest.fixture(scope="module")
def renderer(tiny_dir: Path) -> Renderer:
    return Renderer(load_tokenizer(tiny_dir))


def _prompts(renderer: Renderer) -> list[list[int]]:
    texts = ["hi", "hello there, friend", "reverse: abcdef", "x", "a much longer prompt ok"]
    return [renderer.render_prompt([{"role": "user", "content": t}]) for t in texts]


def _gen(
    rid: str, prompt: list[int], *, seed: int = 0, stop: list[int] | None = None, **sp: Any
) -> GenerateRequest:
    sp.setdefault("max_completion_tokens", 12)
    return GenerateRequest(
        request_id=rid,
        prompt_ids=pack_i32(prompt),
        sampling=SamplingParams(**sp),
        stop_token_ids=stop or [],
        seed=seed,
    )


def _run(engine: TorchEngine, reqs: list[Any]) -> list[Any]:
    return engine.run_batch(reqs, [0.0] * len(reqs))


def _full_logits(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(torch.tensor([ids])).logits[0].float()


def test_batched_greedy_equals_unbatched(engine: TorchEngine, renderer: Renderer) -> None:
    """Left padding, mask and position ids are right: a row's completion ignores its batch."""
    reqs = [
        _gen(str(i), p, temperature=0.0, max_completion_tokens=16)
        for i, p in enumerate(_prompts(renderer))
    ]
    batched = _run(engine, reqs)
    alone = [_run(engine, [r])[0] for r in reqs]
    completions = [i32(b.completion_ids).tolist() for b in batched]
    assert completions == [i32(a.completion_ids).tolist() for a in alone]
    assert len({tuple(c) for c in completions}) == len(reqs)  # the prompts really matter
    for b, a in zip(batched, alone, strict=True):
        torch.testing.assert_close(
            torch.tensor(f32(b.logprobs)), torch.tensor(f32(a.logprobs)), atol=1e-4, rtol=0
        )


def test_logprobs_equal_teacher_forced_forward(engine: TorchEngine, renderer: Renderer) -> None:
    """Each reported logprob is the filtered log-softmax of a full forward at that position."""
    settings = [
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=1.3, top_p=0.5),
        dict(temperature=0.9, top_k=3),
    ]
    reqs = [
        _gen(str(i), p, seed=i, max_completion_tokens=20, **s)
        for i, (p, s) in enumerate(zip(_prompts(renderer), settings, strict=True))
    ]
    for req, res in zip(reqs, _run(engine, reqs), strict=True):
        prompt, comp = i32(req.prompt_ids).tolist(), i32(res.completion_ids).tolist()
        assert len(comp) == len(f32(res.logprobs)) >= 1
        logits = _full_logits(engine, prompt + comp)[len(prompt) - 1 : len(prompt) + len(comp) - 1]
        s = req.sampling
        n = len(comp)
        params = sampling.RowParams.of([s.temperature] * n, [s.top_k] * n, [s.top_p] * n)
        expected = sampling.filtered_logprobs(logits, params).gather(
            -1, torch.tensor(comp)[:, None]
        )
        torch.testing.assert_close(
            torch.tensor(f32(res.logprobs)), expected.squeeze(-1), atol=1e-4, rtol=0
        )


def test_same_seed_same_completion_in_any_batch(engine: TorchEngine, renderer: Renderer) -> None:
    """A sampled completion depends on the request's seed, not on its batch companions."""
    prompts = _prompts(renderer)
    req = _gen("r", prompts[1], seed=42, temperature=1.0, max_completion_tokens=16)
    alone = _run(engine, [req])[0]
    crowd = [_gen(str(i), p, seed=i, temperature=1.0) for i, p in enumerate(prompts)]
    in_batch = _run(engine, [*crowd[:2], req, *crowd[2:]])[2]
    assert i32(in_batch.completion_ids).tolist() == i32(alone.completion_ids).tolist()
    other_seed = _run(engine, [_gen("r", prompts[1], seed=43, temperature=1.0, max_completion_tokens=16)])[0]  # fmt: skip
    assert i32(other_seed.completion_ids).tolist() != i32(alone.completion_ids).tolist()


def test_stop_tokens_end_each_row_and_max_tokens_hold(
    engine: TorchEngine, renderer: Renderer
) -> None:
    """A row stops at its own stop token (kept as the last token); others run to their max."""
    prompts = _prompts(renderer)
    free = _run(engine, [_gen("f", prompts[2], temperature=0.0, max_completion_tokens=16)])[0]
    free_ids = i32(free.completion_ids).tolist()
    assert free.finish_reason == "length" and len(free_ids) == 16
    stop_tok = free_ids[3]
    cut = free_ids.index(stop_tok) + 1
    reqs = [
        _gen("s", prompts[2], temperature=0.0, max_completion_tokens=16, stop=[stop_tok]),
        _gen("l", prompts[4], temperature=0.0, max_completion_tokens=5),
        _gen("z", prompts[3], temperature=0.0, max_completion_tokens=0),
    ]
    stopped, limited, empty = _run(engine, reqs)
    assert stopped.finish_reason == "stop"
    assert i32(stopped.completion_ids).tolist() == free_ids[:cut]
    assert limited.finish_reason == "length" and len(i32(limited.completion_ids)) == 5
    assert empty.finish_reason == "length" and len(i32(empty.completion_ids)) == 0
    # The renderer's <|end|>/eos stop every row without being asked.
    assert set(renderer.stop_token_ids) <= engine.stop_token_ids


def test_stop_string_ends_the_row_on_the_token_completing_it(
    engine: TorchEngine, renderer: Renderer
) -> None:
    """sampling.stop strings stop a row once its decoded text contains one (token kept)."""
    prompt = _prompts(renderer)[2]
    free = _run(engine, [_gen("f", prompt, temperature=0.0, max_completion_tokens=16)])[0]
    free_ids = i32(free.completion_ids).tolist()
    decode = renderer.tokenizer.decode
    stop = decode(free_ids[4:6])
    cut = next(n for n in range(1, 17) if stop in decode(free_ids[:n]))
    assert free.finish_reason == "length" and cut < 16
    req = GenerateRequest(
        request_id="s",
        prompt_ids=pack_i32(prompt),
        sampling=SamplingParams(temperature=0.0, max_completion_tokens=16, stop=[stop]),
    )
    (stopped,) = _run(engine, [req])
    assert stopped.finish_reason == "stop"
    assert i32(stopped.completion_ids).tolist() == free_ids[:cut]


def test_context_limits(engine: TorchEngine) -> None:
    """Too-long prompts fail with context_too_long; completions are clamped to fit."""
    too_long = _gen("long", [10] * MAX_POS, temperature=0.0)
    edge = _gen("edge", [10] * (MAX_POS - 1), temperature=0.0, max_completion_tokens=8)
    near = _gen("near", [10] * (MAX_POS - 3), temperature=0.0, max_completion_tokens=8)
    failed, one, three = _run(engine, [too_long, edge, near])
    assert isinstance(failed, InferenceFailed) and failed.kind == "context_too_long"
    assert isinstance(one, GenerateResult) and len(i32(one.completion_ids)) <= 1
    assert isinstance(three, GenerateResult) and len(i32(three.completion_ids)) <= 3
    assert engine.max_model_len == MAX_POS


def test_bad_requests_fail_alone(engine: TorchEngine, renderer: Renderer) -> None:
    """Invalid ids or sampling params fail their own request; the rest of the batch is served."""
    good = _gen("ok", _prompts(renderer)[0], temperature=0.0)
    bad_id = _gen("id", [5, 10_000], temperature=0.0)
    bad_p = _gen("p", [5, 6], temperature=1.0, top_p=0.0)
    empty = _gen("e", [], temperature=0.0)
    res = _run(engine, [bad_id, good, bad_p, empty])
    assert [type(r).__name__ for r in res] == [
        "InferenceFailed",
        "GenerateResult",
        "InferenceFailed",
        "InferenceFailed",
    ]
    assert all(r.kind == "bad_request" for r in res if isinstance(r, InferenceFailed))


def test_score_matches_full_forward(engine: TorchEngine, renderer: Renderer) -> None:
    """Scored logprobs of token_ids[start:] equal a full forward's log-softmax at temperature T."""
    prompts = _prompts(renderer)
    reqs = [
        ScoreRequest(request_id="a", token_ids=pack_i32(prompts[1]), start=4),
        ScoreRequest(request_id="b", token_ids=pack_i32(prompts[0]), start=1, temperature=0.6),
        ScoreRequest(request_id="c", token_ids=pack_i32(prompts[3]), start=len(prompts[3])),
        ScoreRequest(request_id="d", token_ids=pack_i32(prompts[3]), start=0),
    ]
    a, b, c, d = _run(engine, reqs)
    for res, ids, start, temp in ((a, prompts[1], 4, 1.0), (b, prompts[0], 1, 0.6)):
        assert isinstance(res, ScoreResult)
        logits = _full_logits(engine, ids)[start - 1 : -1] / temp
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(ids[start:])[:, None])
        torch.testing.assert_close(
            torch.tensor(f32(res.logprobs)), expected.squeeze(-1), atol=1e-4, rtol=0
        )
    assert isinstance(c, ScoreResult) and len(f32(c.logprobs)) == 0
    assert isinstance(d, InferenceFailed) and d.kind == "bad_request"


async def test_backend_batches_concurrent_requests(tiny_dir: Path, renderer: Renderer) -> None:
    """Static mode: concurrent generate calls share batches, and each result reports its
    queue time."""
    backend = TorchBackend.from_path(
        tiny_dir, device="cpu", batch_window_ms=50, max_batch_size=8, continuous=False
    )
    prompts = _prompts(renderer)
    reqs = [_gen(str(i), prompts[i % 5], temperature=0.0, max_completion_tokens=4) for i in range(12)]  # fmt: skip
    results = await asyncio.gather(*(backend.generate([r]) for r in reqs))
    await backend.close()
    assert [r[0].request_id for r in results] == [str(i) for i in range(12)]
    assert backend.batcher.stats.largest_batch == 8  # capped at max_batch_size
    assert backend.batcher.stats.batches == 2
    assert all(r[0].queue_s >= 0 and r[0].compute_s > 0 for r in results)


@pytest.mark.parametrize("continuous", [False, True])
async def test_weights_swap_between_batches(
    tiny_dir: Path, renderer: Renderer, continuous: bool
) -> None:
    """A swap requested mid-batch waits for it: that batch keeps the old version and outputs
    (continuous: the swap waits for the live rows)."""
    backend = TorchBackend.from_path(
        tiny_dir, device="cpu", batch_window_ms=0, continuous=continuous
    )
    new_model = load_model(tiny_dir)
    _scramble(new_model, seed=5)
    data = state_dict_to_bytes(new_model)
    prompt = _prompts(renderer)[1]
    req = _gen("w", prompt, temperature=0.0, max_completion_tokens=32)
    (before,) = await backend.generate([req])

    running = asyncio.create_task(backend.generate([req] * 8))
    # Static: a batch is counted once it has run, so one batch counted and the lock held
    # means the second is computing. Continuous: an admission is counted as it happens.
    admitted = 2 if continuous else 1
    while backend.batcher.stats.batches < admitted or not backend.batcher.lock.locked():
        await asyncio.sleep(0.001)  # the batch is now computing in its thread
    await backend.load_weights(data, digest(data), version=3)
    during = await running
    (after,) = await backend.generate([req])
    await backend.close()

    assert [r.policy_version for r in during] == [0] * 8
    assert all(r.completion_ids == before.completion_ids for r in during)
    assert after.policy_version == 3 and backend.policy_version == 3
    assert after.completion_ids != before.completion_ids


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
    from roles.inference import torch_backend

    calls: list[Any] = []
    monkeypatch.setattr(
        torch.cuda, "set_per_process_memory_fraction", lambda f, d=None: calls.append((f, d))
    )

    def fake_load(path: Any, *, dtype: str, device: str, local_files_only: bool) -> Any:
        calls.append({"dtype": dtype, "device": device})
        return load_model(path, dtype=dtype)

    monkeypatch.setattr(torch_backend, "load_model", fake_load)
    asked = "float16" if device == "cuda:1" else "float32"
    fraction = 0.3 if device == "cuda:1" else 0.45
    engine = TorchEngine.from_path(
        tiny_dir, device=device, dtype=asked, gpu_memory_fraction=fraction
    )
    assert calls == [*cap, {"dtype": dtype, "device": device}]
    assert next(engine.model.parameters()).dtype == getattr(torch, dtype)


def test_a_bf16_engine_reports_float32_logprobs_and_casts_published_weights(
    tiny_dir: Path, renderer: Renderer
) -> None:
    """Weights held in bf16 (as on CUDA): the trainer's fp32 bytes load cast to bf16, and
    sampled and scored logprobs are the float32 log-softmax of the bf16 logits."""
    trainer = load_model(tiny_dir)
    _scramble(trainer, seed=7)
    data = state_dict_to_bytes(trainer)
    engine = TorchEngine(load_model(tiny_dir, dtype="bfloat16"), load_tokenizer(tiny_dir))
    engine.load_state(data, digest(data), version=1)
    served = engine.model.state_dict()
    for name, p in trainer.state_dict().items():
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(served[name], p.to(torch.bfloat16)), name

    prompt = _prompts(renderer)[2]
    (res,) = _run(engine, [_gen("g", prompt, temperature=0.0, max_completion_tokens=8)])
    comp = i32(res.completion_ids).tolist()
    logits = _full_logits(engine, prompt + comp)[len(prompt) - 1 : len(prompt) + len(comp) - 1]
    assert logits.dtype == torch.float32  # _full_logits: the bf16 logits, cast
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)
    got = torch.tensor(f32(res.logprobs))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    # A log-softmax taken in bf16 would give only bf16 values; float32 maths does not.
    assert not any(got == got.to(torch.bfloat16).float())

    ids = prompt + comp
    (scored,) = _run(
        engine, [ScoreRequest(request_id="s", token_ids=pack_i32(ids), start=len(prompt))]
    )
    assert isinstance(scored, ScoreResult)
    torch.testing.assert_close(torch.tensor(f32(scored.logprobs)), expected, atol=1e-4, rtol=0)
