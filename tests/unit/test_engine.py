"""Unit tests for the torch inference engine (no NATS): its forward against the model's own,
prefix sharing, per-request determinism, stops, limits, scores, memory, weight swaps.

The tiny model as built (std 0.02 init) is almost uniform and greedily repeats one
token, which would make indexing bugs invisible; the engines here get seeded large
random weights instead (``scramble``), so completions depend on every prompt token.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from roles.inference import sampling
from roles.inference.capacity import KVCacheTooSmall, plan_slots
from roles.inference.engine import TorchEngine
from roles.inference.model_runner import DecoderRunner, UnsupportedModel
from roles.lib.model.loading import load_model, load_tokenizer
from roles.lib.model.render import Renderer
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import digest, state_dict_to_bytes
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


def scramble(model: Any, seed: int, gain: float = 2.0) -> Any:
    """Replace every matrix by seeded N(0, gain^2 / fan_in): a peaky, prompt-sensitive model."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) * gain / p.shape[1] ** 0.5)
    return model.eval()


def qwen3(vocab: int = 300, layers: int = 3, max_pos: int = MAX_POS, seed: int = 3) -> Any:
    """A small Qwen3 (GQA 8:2, q/k norms, untied head) with scrambled weights."""
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=128, intermediate_size=256,
                      num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=32, max_position_embeddings=max_pos, tie_word_embeddings=False)  # fmt: skip
    return scramble(Qwen3ForCausalLM(cfg), seed)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One torch thread, as the inference role runs (``RLBUS_TORCH_THREADS``): a row's
    numbers are then bitwise independent of its batch (with two, GEMMs split rows
    across threads and the last bits move)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(
        tmp_path_factory.mktemp("tiny") / "m", seed=0, max_position_embeddings=MAX_POS
    )


def make_engine(tiny_dir: Path, seed: int = 1, **kw: Any) -> TorchEngine:
    return TorchEngine(scramble(load_model(tiny_dir), seed), load_tokenizer(tiny_dir), **kw)


@pytest.fixture(scope="module")
def engine(tiny_dir: Path) -> TorchEngine:
    return make_engine(tiny_dir)


@pytest.fixture(scope="module")
def renderer(tiny_dir: Path) -> Renderer:
    return Renderer(load_tokenizer(tiny_dir))


TEXTS = ["hi", "hello there, friend", "reverse: abcdef", "x", "a much longer prompt ok",
         "count to ten please", "ab", "what is 2+2?", "zzz", "the quick brown fox"]  # fmt: skip


def prompts_of(renderer: Renderer) -> list[list[int]]:
    return [renderer.render_prompt([{"role": "user", "content": t}]) for t in TEXTS]


def gen(
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


def ids(res: Any) -> list[int]:
    return i32(res.completion_ids).tolist()


def same(a: Any, b: Any) -> bool:
    """Bitwise the same completion: tokens, logprobs, finish reason."""
    return (
        ids(a) == ids(b)
        and f32(a.logprobs).tolist() == f32(b.logprobs).tolist()
        and a.finish_reason == b.finish_reason
    )


def full_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


# -- the forward -----------------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["sdpa", "bmm"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral-window"])
def test_decode_logits_equal_the_models_own_forward(arch: str, attention: str) -> None:
    """Prefill 12 tokens, decode 8 one by one (3 rows, a batch of 4): each decode step's
    logits equal transformers' forward over the whole sequence (float32), with either
    decode attention. Covers plain MHA with tied embeddings, GQA with q/k norms, and a
    sliding window of 8."""
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=106, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=MAX_POS, tie_word_embeddings=True)  # fmt: skip
        model = scramble(LlamaForCausalLM(cfg), 0)
    elif arch == "qwen3":
        model = qwen3()
    else:
        cfg = MistralConfig(vocab_size=200, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                            max_position_embeddings=MAX_POS)  # fmt: skip
        model = scramble(MistralForCausalLM(cfg), 2)
    tokens = torch.randint(
        0, model.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        ref = model(tokens).logits.float()
    runner = DecoderRunner(model, slots=4, max_len=MAX_POS, attention=attention)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits.float(), ref, atol=0, rtol=0)  # fused views
        runner.prefill([(i, 0, tokens[i, :12].tolist()) for i in range(3)])
        got = []
        for t in range(12, 20):
            runner.tokens[:3], runner.pos[:3] = tokens[:, t], t
            got.append(runner.decode(4, t + 1)[:3].float())
    torch.testing.assert_close(torch.stack(got, 1), ref[:, 12:], atol=5e-5, rtol=1e-5)


def test_other_architectures_are_refused_naming_the_alternative() -> None:
    """A model the runner does not compute fails at load with what would serve it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(UnsupportedModel, match="inference.backend = 'vllm'"):
        DecoderRunner(
            GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2)), slots=4, max_len=16
        )


def test_a_prefix_copied_from_another_slot_equals_one_prefilled_in_place() -> None:
    """Prefix sharing: slot 1 copies 30 prompt positions from slot 0 and prefills the
    rest; slot 2 prefills the whole prompt. Their caches and next logits are identical."""
    model = qwen3()
    runner = DecoderRunner(model, slots=4, max_len=MAX_POS)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (41,), generator=g).tolist()
    with torch.no_grad():
        runner.prefill([(0, 0, prompt[:30])])
        runner.copy_prefix([(0, 1, 30)])
        runner.prefill([(1, 30, prompt[30:40]), (2, 0, prompt[:40])])
        cache = runner.cache  # [layers, slots, KV, 2, S, D]
        assert torch.equal(cache[:, 1, :, :, :40], cache[:, 2, :, :, :40])
        runner.tokens[:3], runner.pos[:3] = prompt[40], 40
        logits = runner.decode(4, 41).float()
    assert torch.equal(logits[1], logits[2])
    torch.testing.assert_close(logits[2], full_logits(model, prompt)[-1], atol=5e-5, rtol=1e-5)


# -- generation -------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_generation_equals_transformers_generate(tiny_dir: Path, arch: str) -> None:
    """A greedy completion through the engine is the one transformers' own ``generate``
    gives for the same model (tiny Llama and a Qwen3-architecture model)."""
    model = scramble(load_model(tiny_dir), 1) if arch == "llama" else qwen3(vocab=300, max_pos=128)
    prompts = [[5, 6, 7, 8, 9, 10], [20, 21, 22], [30] * 11]
    expected = []
    for p in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=20,
                                 min_new_tokens=20, pad_token_id=0, eos_token_id=None)  # fmt: skip
        expected.append(out[0, len(p) :].tolist())
    engine = TorchEngine(model, None, stop_token_ids=[])
    got = engine.generate(
        [gen(str(i), p, temperature=0.0, max_completion_tokens=20) for i, p in enumerate(prompts)]
    )
    assert [ids(r) for r in got] == expected
    assert len({tuple(e) for e in expected}) == 3


def test_logprobs_equal_teacher_forced_forward(engine: TorchEngine, renderer: Renderer) -> None:
    """Each reported logprob is the filtered log-softmax of a full forward at that position."""
    settings = [
        dict(temperature=0.7, top_k=20, top_p=0.9),
        dict(temperature=1.0),
        dict(temperature=0.0),
        dict(temperature=1.3, top_p=0.5),
        dict(temperature=0.9, top_k=3),
    ]
    prompts = prompts_of(renderer)
    reqs = [
        gen(str(i), prompts[i], seed=i, max_completion_tokens=20, **s)
        for i, s in enumerate(settings)
    ]
    for req, res in zip(reqs, engine.generate(reqs), strict=True):
        prompt, comp = i32(req.prompt_ids).tolist(), ids(res)
        assert len(comp) == len(f32(res.logprobs)) >= 1
        logits = full_logits(engine.model, prompt + comp)[
            len(prompt) - 1 : len(prompt) + len(comp) - 1
        ]
        s, n = req.sampling, len(comp)
        params = sampling.RowParams.of([s.temperature] * n, [s.top_k] * n, [s.top_p] * n)
        expected = sampling.filtered_logprobs(logits, params).gather(
            -1, torch.tensor(comp)[:, None]
        )
        torch.testing.assert_close(
            torch.tensor(f32(res.logprobs)), expected.squeeze(-1), atol=1e-4, rtol=0
        )


@pytest.mark.parametrize("attention", ["sdpa", "bmm"])  # ("auto": either, by batch size)
def test_a_request_gets_the_same_tokens_alone_batched_mid_decode_and_in_a_used_slot(
    tiny_dir: Path, renderer: Renderer, attention: str
) -> None:
    """Sampled requests (distinct seeds, prompts, budgets) get bitwise the same tokens and
    logprobs alone, in one batch, admitted while others decode, and in a slot another
    request used before; another seed gives another completion (either decode attention)."""
    engine = make_engine(tiny_dir, stop_token_ids=[], attention=attention)
    prompts = prompts_of(renderer)
    budgets = [5, 30, 12, 20, 8, 25, 16, 10, 3, 40]
    reqs = [gen(str(i), p, seed=100 + i, temperature=1.0, max_completion_tokens=n)
            for i, (p, n) in enumerate(zip(prompts, budgets, strict=True))]  # fmt: skip
    alone = [engine.generate([r])[0] for r in reqs]
    batched = engine.generate(reqs)
    # Half now, half after three steps: they join the running batch in freed and new slots.
    rows = [engine.add(r) for r in reqs[::2]]
    for _ in range(3):
        done = engine.step()
    later = [engine.add(r) for r in reqs[1::2]]
    results = {row.req.request_id: res for row, res in done}
    while engine.live:
        results.update({row.req.request_id: res for row, res in engine.step()})
    assert len(rows) + len(later) == len(reqs) and engine.stats.shared_tokens >= 0
    mid = [results[r.request_id] for r in reqs]
    assert len({tuple(ids(a)) for a in alone}) == len(reqs)
    for a, b, m in zip(alone, batched, mid, strict=True):
        assert same(a, b) and same(a, m), a.request_id
    # Slot 0 was used by every run above; a request there now matches its first answer.
    assert same(engine.generate([reqs[1]])[0], alone[1])
    other = engine.generate(
        [gen("1", prompts[1], seed=7, temperature=1.0, max_completion_tokens=30)]
    )[0]
    assert ids(other) != ids(alone[1])


def test_a_pipelined_engine_answers_exactly_as_a_stepwise_one(
    tiny_dir: Path, renderer: Renderer
) -> None:
    """Pipelined (the CUDA default: a step is launched before the last one's output is
    read): every request, with budgets, stop tokens and stop strings, and admitted while
    others decode, gets bitwise what the stepwise engine gives it."""
    prompts = prompts_of(renderer)
    probe = make_engine(tiny_dir).generate(
        [gen("f", prompts[2], temperature=0.0, max_completion_tokens=16)]
    )[0]
    stop_text = renderer.tokenizer.decode(ids(probe)[4:6])
    reqs: list[Any] = [gen(str(i), p, seed=i, temperature=1.0, max_completion_tokens=3 + 4 * i)
                       for i, p in enumerate(prompts)]  # fmt: skip
    reqs.append(
        gen("tok", prompts[2], temperature=0.0, max_completion_tokens=16, stop=[ids(probe)[3]])
    )
    reqs.append(GenerateRequest(request_id="str", prompt_ids=pack_i32(prompts[2]),
                                sampling=SamplingParams(temperature=0.0, max_completion_tokens=16, stop=[stop_text])))  # fmt: skip
    answers = []
    for pipeline in (False, True):
        engine = make_engine(tiny_dir, pipeline=pipeline, max_batch_size=8)
        got = {}
        for r in reqs[:5]:
            engine.add(r)
        for _ in range(4):
            got.update({row.req.request_id: res for row, res in engine.step()})
        waiting = list(reqs[5:])
        while waiting or engine.live:
            while waiting and engine.free:
                engine.add(waiting.pop(0))
            got.update({row.req.request_id: res for row, res in engine.step()})
        got.update({row.req.request_id: res for row, res in engine.flush()})
        answers.append(got)
    assert answers[0].keys() == answers[1].keys() == {r.request_id for r in reqs}
    assert all(same(answers[0][k], answers[1][k]) for k in answers[0])
    assert answers[0]["tok"].finish_reason == answers[0]["str"].finish_reason == "stop"


def test_a_group_prefills_its_prompt_once_and_a_next_turn_only_its_new_tokens(
    tiny_dir: Path, renderer: Renderer
) -> None:
    """Prefix sharing in the engine: 8 rollouts of one prompt prefill it once (the others
    copy it) and answer bitwise as 8 independent prefills would; a second turn whose
    prompt extends the first turn's prompt and completion prefills only the new tokens
    and answers as an independent prefill would (the same tokens; logprobs to 1e-5: the
    first turn's completion was computed by decode steps, whose attention kernel rounds
    differently from the prefill's)."""
    prompt = prompts_of(renderer)[4]
    group = [
        gen(f"g{i}", prompt, seed=i, temperature=1.0, max_completion_tokens=10) for i in range(8)
    ]
    shared = make_engine(tiny_dir, stop_token_ids=[])
    results = shared.generate(group)
    st = shared.stats
    assert st.prefilled_tokens == len(prompt) - 1
    assert st.shared_tokens == 7 * (len(prompt) - 1)
    independent = make_engine(tiny_dir, stop_token_ids=[])
    for r, req in zip(results, group, strict=True):
        independent.slots.forget()  # nothing kept: every request prefills its own prompt
        assert same(r, independent.generate([req])[0])
    turn2 = prompt + ids(results[0]) + renderer.render_prompt([{"role": "user", "content": "more"}])
    before = shared.stats.prefilled_tokens
    (r2,) = shared.generate([gen("t2", turn2, seed=9, temperature=1.0)])
    new_tokens = len(turn2) - (len(prompt) + len(ids(results[0])) - 1) - 1
    assert shared.stats.prefilled_tokens - before == new_tokens
    independent.slots.forget()
    (fresh,) = independent.generate([gen("t2", turn2, seed=9, temperature=1.0)])
    assert ids(r2) == ids(fresh)
    torch.testing.assert_close(
        torch.tensor(f32(r2.logprobs)), torch.tensor(f32(fresh.logprobs)), atol=1e-5, rtol=0
    )


def test_stop_tokens_end_each_row_and_max_tokens_hold(
    engine: TorchEngine, renderer: Renderer
) -> None:
    """A row stops at its own stop token (kept as the last token); others run to their max."""
    prompts = prompts_of(renderer)
    free = engine.generate([gen("f", prompts[2], temperature=0.0, max_completion_tokens=16)])[0]
    free_ids = ids(free)
    assert free.finish_reason == "length" and len(free_ids) == 16
    stop_tok = free_ids[3]
    cut = free_ids.index(stop_tok) + 1
    reqs = [
        gen("s", prompts[2], temperature=0.0, max_completion_tokens=16, stop=[stop_tok]),
        gen("l", prompts[4], temperature=0.0, max_completion_tokens=5),
        gen("z", prompts[3], temperature=0.0, max_completion_tokens=0),
    ]
    stopped, limited, empty = engine.generate(reqs)
    assert stopped.finish_reason == "stop" and ids(stopped) == free_ids[:cut]
    assert limited.finish_reason == "length" and len(ids(limited)) == 5
    assert empty.finish_reason == "length" and ids(empty) == []
    assert set(renderer.stop_token_ids) <= engine.stop_token_ids  # <|end|>/eos, unasked


def test_stop_string_ends_the_row_on_the_token_completing_it(
    engine: TorchEngine, renderer: Renderer
) -> None:
    """sampling.stop strings stop a row once its decoded text contains one (token kept)."""
    prompt = prompts_of(renderer)[2]
    free_ids = ids(
        engine.generate([gen("f", prompt, temperature=0.0, max_completion_tokens=16)])[0]
    )
    decode = renderer.tokenizer.decode
    stop = decode(free_ids[4:6])
    cut = next(n for n in range(1, 17) if stop in decode(free_ids[:n]))
    assert cut < 16
    req = GenerateRequest(request_id="s", prompt_ids=pack_i32(prompt),
                          sampling=SamplingParams(temperature=0.0, max_completion_tokens=16, stop=[stop]))  # fmt: skip
    (stopped,) = engine.generate([req])
    assert stopped.finish_reason == "stop" and ids(stopped) == free_ids[:cut]


def test_context_limits(engine: TorchEngine) -> None:
    """Too-long prompts fail with context_too_long; completions are clamped to fit."""
    too_long = gen("long", [10] * MAX_POS, temperature=0.0)
    edge = gen("edge", [10] * (MAX_POS - 1), temperature=0.0, max_completion_tokens=8)
    near = gen("near", [10] * (MAX_POS - 3), temperature=0.0, max_completion_tokens=8)
    failed, one, three = engine.generate([too_long, edge, near])
    assert isinstance(failed, InferenceFailed) and failed.kind == "context_too_long"
    assert isinstance(one, GenerateResult) and len(ids(one)) == 1
    assert isinstance(three, GenerateResult) and len(ids(three)) == 3
    assert engine.max_len == MAX_POS


def test_bad_requests_fail_alone(engine: TorchEngine, renderer: Renderer) -> None:
    """Invalid ids or sampling params fail their own request; the rest are served."""
    good = gen("ok", prompts_of(renderer)[0], temperature=0.0)
    res = engine.generate(
        [gen("id", [5, 10_000]), good, gen("p", [5, 6], temperature=1.0, top_p=0.0), gen("e", [])]
    )
    assert [type(r).__name__ for r in res] == [
        "InferenceFailed",
        "GenerateResult",
        "InferenceFailed",
        "InferenceFailed",
    ]
    assert all(r.kind == "bad_request" for r in res if isinstance(r, InferenceFailed))


def test_score_matches_full_forward(engine: TorchEngine, renderer: Renderer) -> None:
    """Scored logprobs of token_ids[start:] equal a full forward's log-softmax at temperature T."""
    prompts = prompts_of(renderer)
    reqs = [
        ScoreRequest(request_id="a", token_ids=pack_i32(prompts[1]), start=4),
        ScoreRequest(request_id="b", token_ids=pack_i32(prompts[0]), start=1, temperature=0.6),
        ScoreRequest(request_id="c", token_ids=pack_i32(prompts[3]), start=len(prompts[3])),
        ScoreRequest(request_id="d", token_ids=pack_i32(prompts[3]), start=0),
    ]
    a, b, c, d = engine.run_batch(reqs)  # type: ignore[arg-type]
    for res, toks, start, temp in ((a, prompts[1], 4, 1.0), (b, prompts[0], 1, 0.6)):
        assert isinstance(res, ScoreResult)
        logits = full_logits(engine.model, toks)[start - 1 : -1] / temp
        expected = logits.log_softmax(-1).gather(-1, torch.tensor(toks[start:])[:, None])
        torch.testing.assert_close(
            torch.tensor(f32(res.logprobs)), expected.squeeze(-1), atol=1e-4, rtol=0
        )
    assert isinstance(c, ScoreResult) and len(f32(c.logprobs)) == 0
    assert isinstance(d, InferenceFailed) and d.kind == "bad_request"


# -- memory ---------------------------------------------------------------------------------


def test_the_kv_budget_sizes_the_slots_and_one_too_small_is_refused(tiny_dir: Path) -> None:
    """The cache gets max_batch_size slots when the budget holds them, fewer when it does
    not, and a budget without room for one sequence is refused naming the keys."""
    model = load_model(tiny_dir)
    per_token = 2 * model.config.num_hidden_layers * model.config.hidden_size * 4
    assert plan_slots(64, MAX_POS, per_token, 10**9) == 64
    assert plan_slots(6, MAX_POS, per_token, 10**9) == 6  # 8 slots allocated: rows pad to 4s
    assert plan_slots(64, MAX_POS, per_token, 10 * MAX_POS * per_token) == 8
    with pytest.raises(KVCacheTooSmall, match="inference.kv_cache_gb.*inference.max_model_len"):
        plan_slots(64, MAX_POS, per_token, 4 * MAX_POS * per_token - 1)
    small = TorchEngine(model, None, max_batch_size=64, kv_cache_bytes=10 * MAX_POS * per_token)
    heads = model.config.num_attention_heads
    assert small.max_rows == 8 and small.runner.cache.shape[1:5] == (8, heads, 2, MAX_POS)
    reqs = [gen(str(i), [5 + i, 6, 7], max_completion_tokens=4) for i in range(12)]
    assert [len(ids(r)) for r in small.generate(reqs)] == [4] * 12  # 12 requests, 8 slots
    short = TorchEngine(load_model(tiny_dir), None, max_model_len=16)
    (refused,) = short.generate([gen("x", [5] * 16)])
    assert isinstance(refused, InferenceFailed) and refused.kind == "context_too_long"


# -- weights ----------------------------------------------------------------------------------


def test_a_weights_swap_lands_between_steps_with_no_row_live_and_forgets_prefixes(
    tiny_dir: Path, renderer: Renderer
) -> None:
    """Weights load only with no row live (the loop holds them back); after a swap a
    prompt kept from before is prefilled again (its old keys and values are stale) and
    answers with the new weights, as a fresh engine with them would."""
    engine = make_engine(tiny_dir, stop_token_ids=[])
    new = scramble(load_model(tiny_dir), seed=5)
    data = state_dict_to_bytes(new)
    prompt = prompts_of(renderer)[1]
    req = gen("w", prompt, temperature=1.0, seed=3, max_completion_tokens=12)
    (before,) = engine.generate([req])
    engine.add(req)
    with pytest.raises(RuntimeError, match="rows live"):
        engine.load_state(data, digest(data), version=3)
    while engine.live:
        engine.step()
    engine.load_state(data, digest(data), version=3)
    prefilled = engine.stats.prefilled_tokens
    (after,) = engine.generate([req])
    assert engine.stats.prefilled_tokens - prefilled == len(prompt) - 1
    assert after.policy_version == 3 and before.policy_version == 0
    fresh = TorchEngine(scramble(load_model(tiny_dir), seed=5), None, stop_token_ids=[])
    assert same(after, fresh.generate([req])[0]) and not same(after, before)


def test_a_bf16_engine_reports_float32_logprobs_and_casts_published_weights(
    tiny_dir: Path, renderer: Renderer
) -> None:
    """Weights held in bf16 (as on CUDA): the trainer's fp32 bytes load cast to bf16, and
    sampled and scored logprobs are float32 log-softmaxes of bf16 logits (close to the
    model's own bf16 forward: its kernels round differently)."""
    trainer = scramble(load_model(tiny_dir), seed=7)
    data = state_dict_to_bytes(trainer)
    engine = TorchEngine(load_model(tiny_dir, dtype="bfloat16"), load_tokenizer(tiny_dir))
    engine.load_state(data, digest(data), version=1)
    served = engine.model.state_dict()
    for name, p in trainer.state_dict().items():
        assert served[name].dtype == torch.bfloat16
        assert torch.equal(served[name], p.to(torch.bfloat16)), name
    prompt = prompts_of(renderer)[2]
    (res,) = engine.generate([gen("g", prompt, temperature=0.0, max_completion_tokens=8)])
    comp = ids(res)
    logits = full_logits(engine.model, prompt + comp)[len(prompt) - 1 : len(prompt) + len(comp) - 1]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(comp)[:, None]).squeeze(-1)
    got = torch.tensor(f32(res.logprobs))
    torch.testing.assert_close(got, expected, atol=0.25, rtol=0)
    assert not any(got == got.to(torch.bfloat16).float())  # float32 maths, not bf16
    (scored,) = engine.score(
        [ScoreRequest(request_id="s", token_ids=pack_i32(prompt + comp), start=len(prompt))]
    )
    assert isinstance(scored, ScoreResult)
    torch.testing.assert_close(torch.tensor(f32(scored.logprobs)), expected, atol=1e-4, rtol=0)


def test_graphs_captured_at_start_cover_every_step_shape(engine: TorchEngine) -> None:
    """inference.graphs_at_start: ``graph_shapes`` lists every (rows, columns) bucket a CUDA
    step can take, each once, shortest lengths first then fewest rows, so capturing a
    prefix of it at start covers every short step (the GPU half: tests/gpu); on the CPU
    nothing is captured."""
    shapes = engine.graph_shapes()
    reachable = {
        engine._graph_shape(top, longest, False)
        for top in range(1, engine.n_slots + 1)
        for longest in range(1, engine.runner.width + 1)
    }
    assert set(shapes) == reachable and len(shapes) == len(reachable)
    assert shapes == sorted(shapes, key=lambda s: (s[1], s[0]))
    assert all(b % 4 == 0 and b <= engine.n_slots and span <= engine.runner.width
               for b, span, _ in shapes)  # fmt: skip
    assert engine.capture_graphs(len(shapes)) == 0 and not engine._graphs
