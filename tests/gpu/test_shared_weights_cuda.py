"""Weights shared through CUDA IPC (``trainer.weights_via = "ipc"`` on one GPU): another
process copies the trainer's ring slot device to device and checks its device digest,
and a swap lands in flight under captured graphs (needs a CUDA GPU; skipped otherwise).
The same code over a /dev/shm file is proven on the CPU (tests/unit/test_shared_weights.py,
tests/unit/test_torch_backend.py)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from roles.inference.engine import TorchEngine  # noqa: E402
from roles.inference.torch_backend import TorchBackend  # noqa: E402
from roles.lib.model.shared_weights import Layout, SharedReader, WeightsRing  # noqa: E402
from tests.gpu.test_engine_cuda import llama  # noqa: E402
from tests.unit.test_engine import gen, ids  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _child(ref: Any, out: Any) -> None:
    target = llama(torch.bfloat16, seed=9)
    reader = SharedReader(Layout.of(target.state_dict()), torch.device("cuda"))
    start = time.perf_counter()
    staged = reader.read(ref)
    torch.cuda.synchronize()
    read_s = time.perf_counter() - start
    reader.load_into(target, staged)
    out.put((read_s, {k: float(v.double().sum()) for k, v in target.state_dict().items()}))


def test_another_process_reads_the_ring_through_cuda_ipc(tmp_path: Any) -> None:
    trainer = llama(torch.float32, seed=1)
    ring = WeightsRing.create(Layout.of(trainer.state_dict()), torch.bfloat16,
                              torch.device("cuda"), tmp_path)  # fmt: skip
    assert ring.handle.startswith("cuda:")
    ref = ring.write(7, trainer.state_dict())
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_child, args=(ref, out))
    child.start()
    read_s, sums = out.get(timeout=120)
    child.join(30)
    assert child.exitcode == 0
    for name, t in trainer.state_dict().items():
        assert sums[name] == float(t.to(torch.bfloat16).double().sum()), name
    print(f"\nread + digest of {ref.size / 1e6:.1f} MB in another process: {read_s * 1e3:.2f} ms")


def test_an_in_flight_swap_under_graphs_records_its_span_and_keeps_earlier_tokens(
    tmp_path: Any,
) -> None:
    # float32 (TF32 off): the tokens before the swap equal a run without it, bitwise.
    torch.backends.cuda.matmul.allow_tf32 = False
    engine = TorchEngine(llama(torch.float32), None, stop_token_ids=[], max_batch_size=64)
    new = llama(torch.float32, seed=4)
    ring = WeightsRing.create(
        Layout.of(new.state_dict()), torch.float32, torch.device("cuda"), tmp_path
    )
    ref = ring.write(3, new.state_dict())
    reqs = [gen(str(i), [5, 6, 7, 8 + i], seed=i, temperature=1.0, max_completion_tokens=120)
            for i in range(32)]  # fmt: skip
    before = engine.generate(reqs)  # graphs captured

    async def main() -> tuple[list[Any], float]:
        backend = TorchBackend(engine, batch_window_ms=0)
        running = asyncio.create_task(backend.generate(reqs))
        steps = engine.stats.steps
        while engine.stats.steps < steps + 20:
            await asyncio.sleep(0.001)
        paused = await backend.load_shared(ref, version=3)
        results = await running
        await backend.close()
        return results, paused

    results, paused = asyncio.run(main())
    spans = [r.version_spans for r in results]
    assert all(len(s) == 1 and s[0][1] == 3 for s in spans), spans
    at = spans[0][0][0]
    assert all(ids(r)[:at] == ids(b)[:at] for r, b in zip(results, before, strict=True))
    assert engine.policy_version == 3
    print(f"\nin-flight swap pause (copy + sync): {paused * 1e3:.2f} ms at token {at}")
