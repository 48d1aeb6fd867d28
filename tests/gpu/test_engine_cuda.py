"""The torch engine on a CUDA GPU: captured graphs against eager steps, logits against the
model's own forward, a Qwen3 through the engine, a weights swap under graphs (needs a
CUDA GPU; skipped otherwise). Correctness is proven on the CPU (tests/unit/test_engine.py);
these check what only a GPU runs: graph capture and replay, the bf16 path."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from roles.inference.engine import TorchEngine  # noqa: E402
from roles.inference.model_runner import DecoderRunner  # noqa: E402
from roles.lib.model.weights import digest, state_dict_to_bytes  # noqa: E402
from tests.unit.test_engine import gen, ids, qwen3, same, scramble  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def llama(dtype: Any, seed: int = 0) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=106, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                      num_attention_heads=4, max_position_embeddings=256, tie_word_embeddings=True)  # fmt: skip
    return scramble(LlamaForCausalLM(cfg), seed).to("cuda", dtype)


def requests(n: int, new: int = 24) -> list[Any]:
    g = torch.Generator().manual_seed(5)
    return [gen(str(i), torch.randint(1, 100, (5 + i % 23,), generator=g).tolist(), seed=i,
                temperature=1.0 if i % 3 else 0.0, max_completion_tokens=new + i % 7)
            for i in range(n)]  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_gives_the_eager_steps_tokens(dtype: str) -> None:
    """The same requests decoded with captured graphs and with eager steps (same shapes)
    get bitwise the same tokens and logprobs; a row's tokens do not depend on its company."""
    engine = TorchEngine(llama(getattr(torch, dtype)), None, stop_token_ids=[], max_batch_size=64)
    reqs = requests(40)
    graphed = engine.generate(reqs)
    assert engine._graphs  # captured
    engine.cuda_graphs = False
    engine.slots.forget()
    eager = engine.generate(reqs)
    assert all(same(g, e) for g, e in zip(graphed, eager, strict=True))
    engine.cuda_graphs = True
    engine.slots.forget()
    alone = [engine.generate([r])[0] for r in reqs[:6]]
    if dtype == "float32":  # cuBLAS picks kernels by batch size: bf16 may move a last bit
        assert [ids(a) for a in alone] == [ids(g) for g in graphed[:6]]


def test_decode_logits_equal_the_models_own_forward_on_cuda() -> None:
    """float32 on CUDA: decode logits equal transformers' forward (TF32 off); bfloat16:
    the same argmax nearly everywhere and logits within bf16 rounding."""
    for dtype, atol in ((torch.float32, 2e-3), (torch.bfloat16, 0.25)):
        model = qwen3().to("cuda", dtype)
        tokens = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(0)).cuda()
        with torch.no_grad():
            ref = model(tokens).logits.float()
        runner = DecoderRunner(model, slots=4, max_len=64)
        with torch.no_grad():
            runner.prefill([(i, 0, tokens[i, :12].tolist()) for i in range(3)])
            got = []
            for t in range(12, 20):
                runner.tokens[:3], runner.pos[:3] = tokens[:, t], t
                got.append(runner.decode(4, 64)[:3].float())
        got_t = torch.stack(got, 1)
        torch.testing.assert_close(
            got_t, ref[:, 12:], atol=atol * ref.abs().max().item() / 10, rtol=0
        )
        assert (got_t.argmax(-1) == ref[:, 12:].argmax(-1)).float().mean() > 0.9


def test_a_qwen3_generates_greedily_as_transformers_does_and_swaps_weights_under_graphs() -> None:
    """float32 on CUDA: greedy completions equal transformers' ``generate``; after a swap
    between steps (graphs captured before it) the engine answers as a fresh one with the
    new weights: the graphs read the weights in place."""
    model = qwen3(max_pos=128).to("cuda")
    engine = TorchEngine(model, None, stop_token_ids=[], max_batch_size=8)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [30] * 11]
    reqs = [
        gen(str(i), p, temperature=0.0, max_completion_tokens=20) for i, p in enumerate(prompts)
    ]
    got = engine.generate(reqs)
    for p, r in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=20,
                                 min_new_tokens=20, pad_token_id=0, eos_token_id=None)  # fmt: skip
        assert ids(r) == out[0, len(p) :].tolist()
    new = qwen3(max_pos=128, seed=11)
    data = state_dict_to_bytes(new)
    engine.load_state(data, digest(data), version=2)
    after = engine.generate(reqs)
    fresh = TorchEngine(
        new.to("cuda"), None, stop_token_ids=[], max_batch_size=8, cuda_graphs=False
    )
    assert [ids(r) for r in after] == [ids(r) for r in fresh.generate(reqs)]
    assert after[0].policy_version == 2 and ids(after[0]) != ids(got[0])


def test_graphs_captured_at_start_leave_no_capture_to_a_run() -> None:
    """inference.graphs_at_start: every shape captured before serving; a run of requests
    that fits the captured lengths captures nothing more (a weights swap never waits for a
    capture), and the tokens equal those of an engine capturing on first use."""
    engine = TorchEngine(llama(torch.bfloat16), None, stop_token_ids=[], max_batch_size=64)
    held = engine.capture_graphs(len(engine.graph_shapes()))
    assert held == len(engine.graph_shapes()) > 0
    reqs = requests(40)
    at_start = engine.generate(reqs)
    assert len(engine._graphs) == held
    lazy = TorchEngine(llama(torch.bfloat16), None, stop_token_ids=[], max_batch_size=64)
    assert [ids(r) for r in lazy.generate(reqs)] == [ids(r) for r in at_start]
