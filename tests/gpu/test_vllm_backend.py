"""The vLLM backend against the torch backend (needs vLLM and a CUDA GPU; skipped otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="the vllm extra is not installed")
torch = pytest.importorskip("torch")

from roles.inference.torch_backend import TorchBackend  # noqa: E402
from roles.inference.vllm_backend import VllmBackend  # noqa: E402
from roles.lib.model.loading import load_model  # noqa: E402
from roles.lib.model.tiny import build_tiny_model  # noqa: E402
from roles.lib.model.weights import WeightsDigestMismatch, digest, state_dict_to_bytes  # noqa: E402
from schemas import GenerateRequest, GenerateResult, SamplingParams  # noqa: E402
from schemas.arrays import f32, i32, pack_i32  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

PROMPTS = [[5, 40, 41, 42, 8, 6], [5, 60, 8, 6], [5, 70, 71, 72, 73, 74, 75, 8, 6]]


def _scrambled_bytes(path: Path, seed: int) -> bytes:
    model = load_model(path)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / p.shape[1] ** 0.5)
    return state_dict_to_bytes(model)


def _reqs(temperature: float = 0.0) -> list[GenerateRequest]:
    sp = SamplingParams(temperature=temperature, max_completion_tokens=12)
    return [
        GenerateRequest(request_id=str(i), prompt_ids=pack_i32(p), sampling=sp, seed=i)
        for i, p in enumerate(PROMPTS)
    ]


async def test_vllm_matches_torch_greedy_and_swaps_weights(tmp_path: Path) -> None:
    """Greedy completions and logprobs agree with the torch backend before and after a swap."""
    path = build_tiny_model(tmp_path / "m", seed=0)
    data = _scrambled_bytes(path, seed=1)
    vb = VllmBackend(path, dtype="float32", weights_dir=tmp_path / "w", gpu_memory_utilization=0.3)
    tb = TorchBackend.from_path(path, device="cuda")
    try:
        for version in (0, 1):
            if version:
                with pytest.raises(WeightsDigestMismatch):
                    await vb.load_weights(data, "sha256:" + "0" * 64, 1)
                assert vb.policy_version == 0
                await vb.load_weights(data, digest(data), 1)
                await tb.load_weights(data, digest(data), 1)
            got, want = await vb.generate(_reqs()), await tb.generate(_reqs())
            for g, w in zip(got, want, strict=True):
                assert isinstance(g, GenerateResult) and isinstance(w, GenerateResult)
                assert g.policy_version == version
                assert i32(g.completion_ids).tolist() == i32(w.completion_ids).tolist()
                assert g.finish_reason == w.finish_reason
                assert torch.allclose(
                    torch.tensor(f32(g.logprobs)), torch.tensor(f32(w.logprobs)), atol=1e-3
                )
    finally:
        await vb.close()
        await tb.close()
