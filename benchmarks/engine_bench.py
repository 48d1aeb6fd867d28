"""Generation speed of the torch engine against transformers' own ``generate``, same model.

For each model (``default``: the default preset's tiny Llama, 0.34 M parameters; ``gpu``:
the ``gpu`` preset's Llama, 99 M; ``qwen3``: a Qwen3-0.6B-shaped model, 596 M, 151,936
vocabulary), built locally with random weights and served in the serving dtype of the
device (float32 on the CPU, bfloat16 on CUDA), on one machine in one run:

- ``engine``: ``TorchEngine.generate`` of B requests (distinct prompts of ``prompt``
  tokens, temperature 1, no stop token, ``new`` tokens each), warm (one untimed call at
  the same B first: on CUDA it captures the step's graphs). Tokens/s over the whole call
  (prefill included) and ms per decode step (the call's wall time over its steps);
- ``hf_dynamic`` / ``hf_static``: ``model.generate`` on the same model object, the same
  prompts, sampling and token count (``min_new_tokens`` = ``max_new_tokens``), with its
  default dynamic KV cache and with ``cache_implementation="static"``, warm too. The
  faster of the two is the reference (``vs_hf``: engine tokens/s over it);
- ``engine_groups``: the same, with the B requests in GRPO groups of 8 sharing a prompt
  (the default preset's group size), as a run sends them: each group's prompt is
  prefilled once (``vs_hf_groups``: over the best HF figure at that B, whose work does
  not depend on which prompts repeat);
- ``prefill``: a GRPO group (16 requests, one prompt; 4 for the Qwen3 shape on a CPU)
  admitted into the engine, the time to put their prompts in the cache with prefix
  sharing (one prefill, the others copy it) and without (a prefill each);
- ``ops_per_step``: the ATen ops one decode step dispatches at B=256 (torch profiler):
  ``top`` counts the calls the step's Python makes (each a dispatch through the op
  registry), ``all`` adds the ops those run inside ATen.

Every engine measurement of every model runs before any HF reference (``generate``
with a static cache compiles the model's forward with CUDA graphs of its own). Timed
calls: the fastest of ``--repeats`` (3; one with ``--quick`` on the CPU, and for the
Qwen3 shape's HF references). ``--compare-attention`` also times the engine with the
decode attention it does not use by default (``sdpa`` / ``bmm``:
``DecoderRunner._decode_attention``).

Results: ``benchmarks/results/engine.json`` and ``engine.md`` (``--name`` changes the
stem). Torch threads follow ``RLBUS_TORCH_THREADS`` (default 1, as the inference role).

    python -m benchmarks.engine_bench [--quick] [--device cuda] [--models default,gpu,qwen3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import RESULTS, save
from roles.inference.engine import TorchEngine
from roles.inference.model_runner import ATTENTION
from roles.inference.torch_setup import configure_torch_threads
from schemas import GenerateRequest, GenerateResult, SamplingParams
from schemas.arrays import i32, pack_i32

GROUP = 16  # rollouts per prompt in the prefix-sharing measurement


def build_model(name: str) -> Any:
    """A model of the named shape with seeded random weights (nothing downloaded)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from roles.lib.model.tiny import init_weights, tiny_config
    from roles.lib.model.tokenizer import build_tokenizer

    if name == "default":
        return init_weights(tiny_config(build_tokenizer()), seed=0)
    if name == "gpu":
        cfg = tiny_config(build_tokenizer(), hidden_size=768, num_layers=12, num_heads=12,
                          intermediate_size=2560, max_position_embeddings=256)  # fmt: skip
        return init_weights(cfg, seed=0)
    if name == "qwen3":  # Qwen3-0.6B's shape
        cfg = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                          num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, max_position_embeddings=512, tie_word_embeddings=True,
                          rope_theta=1_000_000.0)  # fmt: skip
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            return Qwen3ForCausalLM(cfg).eval()
    raise ValueError(f"unknown model {name!r}")


def plan(name: str, device: str, quick: bool) -> dict[str, Any]:
    """Prompt length, new tokens and batch sizes (engine, HF dynamic, HF static) for a
    model on a device. HF's static cache compiles the forward once per batch size (10-30
    s each on a GPU), so it runs at fewer sizes."""
    if device.startswith("cuda"):
        if name == "qwen3":
            return {
                "prompt": 128,
                "new": 256,
                "batches": [1, 64, 256],
                "hf": [256],
                "hf_static": [256],
                "ops": True,
            }
        if name == "gpu":
            b = [1, 64, 256, 1024]
            return {"prompt": 27, "new": 16, "batches": b, "hf": b, "hf_static": [256], "ops": True}
        return {
            "prompt": 27,
            "new": 16,
            "batches": [1, 64, 256, 1024],
            "hf": [64, 256],
            "hf_static": [],
            "ops": True,
        }
    if name == "qwen3":  # 0.6 B on a CPU: a few rows, a group of 4 for the prefill
        b = [4] if quick else [1, 4]
        return {
            "prompt": 128,
            "new": 8 if quick else 16,
            "batches": b,
            "hf": b,
            "hf_static": [] if quick else b,
            "ops": not quick,
            "group": 4,
        }
    if name == "gpu":
        b = [1, 16] if quick else [1, 64]
        return {
            "prompt": 27,
            "new": 16,
            "batches": b,
            "hf": b,
            "hf_static": [] if quick else b,
            "ops": True,
        }
    b = [1, 64, 256]
    return {"prompt": 27, "new": 16, "batches": b, "hf": b, "hf_static": b, "ops": True}


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def prompts_for(n: int, length: int, vocab: int, offset: int = 0) -> list[list[int]]:
    """``n`` distinct prompts of ``length`` ids (never 0: the pad id of HF generate)."""
    g = torch.Generator().manual_seed(1000 + offset)
    return torch.randint(1, vocab, (n, length), generator=g).tolist()


def requests(prompts: list[list[int]], new: int, tag: str) -> list[GenerateRequest]:
    return [
        GenerateRequest(
            request_id=f"{tag}{i}",
            prompt_ids=pack_i32(p),
            sampling=SamplingParams(temperature=1.0, max_completion_tokens=new),
            seed=i,
        )  # fmt: skip
        for i, p in enumerate(prompts)
    ]


def timed(fn: Callable[[], Any], device: str, repeats: int) -> tuple[float, Any]:
    """The fastest of ``repeats`` timed calls (after one untimed warm-up call)."""
    fn()
    best, out = float("inf"), None
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        out = fn()
        sync(device)
        best = min(best, time.perf_counter() - t)
    return best, out


def bench_engine(
    engine: TorchEngine,
    vocab: int,
    p: dict[str, Any],
    b: int,
    device: str,
    repeats: int,
    group: int = 1,
) -> dict[str, Any]:
    prompts = [q for q in prompts_for(max(1, b // group), p["prompt"], vocab) for _ in range(group)]
    reqs = requests(prompts[:b], p["new"], "e")

    def run() -> list[Any]:
        engine.slots.forget()  # no prompt kept from the warm-up: every call prefills
        steps = engine.stats.steps
        out = engine.generate(reqs)
        return [engine.stats.steps - steps, out]

    wall, (steps, out) = timed(run, device, repeats)
    tokens = sum(len(i32(r.completion_ids)) for r in out if isinstance(r, GenerateResult))
    assert tokens == b * p["new"], f"{tokens} tokens for {b} x {p['new']}"
    return {"tokens_per_s": round(tokens / wall, 1), "ms_per_step": round(wall / steps * 1e3, 3),
            "wall_s": round(wall, 4), "steps": steps}  # fmt: skip


def bench_hf(
    model: Any, vocab: int, p: dict[str, Any], b: int, device: str, repeats: int, static: bool
) -> dict[str, Any]:
    ids = torch.tensor(prompts_for(b, p["prompt"], vocab), device=device)
    kw: dict[str, Any] = dict(
        attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        max_new_tokens=p["new"], min_new_tokens=p["new"], pad_token_id=0,
    )  # fmt: skip
    if static:
        kw["cache_implementation"] = "static"

    def run() -> Any:
        with torch.inference_mode():
            return model.generate(ids, **kw)

    try:
        wall, out = timed(run, device, repeats)
    except Exception as e:  # noqa: BLE001 - a reference that fails is reported, not fatal
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    tokens = (out.shape[1] - ids.shape[1]) * b
    return {"tokens_per_s": round(tokens / wall, 1), "ms_per_step": round(wall / p["new"] * 1e3, 3),
            "wall_s": round(wall, 4)}  # fmt: skip


def bench_prefill(
    engine: TorchEngine, vocab: int, p: dict[str, Any], device: str, repeats: int
) -> dict[str, Any]:
    """Admit a group of GROUP requests of one prompt: the time to prefill them, with and
    without prefix sharing (the rows are dropped unanswered)."""
    (prompt,) = prompts_for(1, p["prompt"], vocab, offset=7)
    group = p.get("group", GROUP)
    reqs = requests([prompt] * group, p["new"], "g")
    out: dict[str, Any] = {"group": group, "prompt_tokens": p["prompt"]}
    for share in (True, False):
        engine.slots.share_prefixes = share

        def run() -> int:
            engine.slots.forget()
            rows = [engine.add(r) for r in reqs]
            before = engine.stats.prefilled_tokens
            engine.start()
            sync(device)
            for row in rows:
                engine.drop(row)  # type: ignore[arg-type]
            return engine.stats.prefilled_tokens - before

        wall, prefilled = timed(run, device, repeats)
        out["shared" if share else "independent"] = {
            "ms": round(wall * 1e3, 3),
            "prefilled_tokens": prefilled,
        }
    engine.slots.share_prefixes = True
    out["speedup"] = round(out["independent"]["ms"] / out["shared"]["ms"], 2)
    return out


def count_ops(engine: TorchEngine, vocab: int) -> dict[str, int]:
    """ATen ops of one decode step with 256 live rows (4-token prompts: the prompt length
    does not change what a decode step dispatches)."""
    from torch.profiler import ProfilerActivity, profile

    n = min(256, engine.free)  # (a big model's CPU budget may hold fewer slots)
    reqs = requests(prompts_for(n, 4, vocab, offset=3), 64, "o")
    rows = [engine.add(r) for r in reqs]
    engine.step()
    engine.step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    for row in rows:
        engine.drop(row)  # type: ignore[arg-type]
    events = prof.events()
    return {"batch": n, "top": sum(1 for e in events if e.cpu_parent is None), "all": len(events)}


def bench_engine_side(
    name: str, args: argparse.Namespace, device: str
) -> tuple[dict[str, Any], Any]:
    """Everything measured on the engine for one model (and the model, for ``bench_hf_side``)."""
    p = plan(name, device, args.quick)
    t0 = time.perf_counter()
    model = build_model(name)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = model.to(device=device, dtype=dtype)
    model.generation_config.eos_token_id = None  # every row generates its full budget
    vocab = int(model.config.vocab_size)
    params = sum(x.numel() for x in model.parameters())
    slots = max(max(p["batches"]), 256 if p["ops"] else 0, GROUP)
    max_len = max(p["prompt"] + p["new"], 68)

    def make(attention: str | None = None) -> TorchEngine:
        return TorchEngine(model, None, stop_token_ids=[], max_batch_size=slots, max_model_len=max_len,
                           cuda_graphs=not args.no_graphs, attention=attention)  # fmt: skip

    engine = make()
    out: dict[str, Any] = {"params": params, "dtype": str(dtype).removeprefix("torch."), **p,
                           "kv_slots": engine.max_rows, "attention": engine.runner.attention,
                           "engine": {}, "hf_dynamic": {}, "hf_static": {}}  # fmt: skip
    repeats = args.repeats if device.startswith("cuda") or not args.quick else 1
    for b in p["batches"]:
        out["engine"][b] = bench_engine(engine, vocab, p, b, device, repeats)
        log(name, f"engine      B={b:5d}", out["engine"][b])
    out["engine_groups"] = {}
    for b in [b for b in p["batches"] if b >= 64]:
        out["engine_groups"][b] = bench_engine(engine, vocab, p, b, device, repeats, group=8)
        log(name, f"engine, groups of 8, B={b:5d}", out["engine_groups"][b])
    out["prefill"] = bench_prefill(engine, vocab, p, device, repeats)
    log(name, "prefill", out["prefill"])
    if p["ops"]:
        out["ops_per_step"] = count_ops(engine, vocab)
        log(name, "ops per step", out["ops_per_step"])
    del engine
    if args.compare_attention:  # the other decode attention, same calls
        out["engine_by_attention"] = {}
        for attention in [a for a in ATTENTION if a not in (out["attention"], "auto")]:
            other, runs = make(attention), {}
            for b in p["batches"]:
                runs[b] = bench_engine(other, vocab, p, b, device, repeats)
                log(name, f"engine ({attention}) B={b:5d}", runs[b])
            out["engine_by_attention"][attention] = runs
            del other
    out["bench_s"] = round(time.perf_counter() - t0, 1)
    return out, model


def bench_hf_side(
    name: str, model: Any, out: dict[str, Any], args: argparse.Namespace, device: str
) -> None:
    """transformers' ``generate`` on the same model (after every engine measurement: its
    static cache compiles the forward, with CUDA graphs of its own), and the ratios."""
    p = plan(name, device, args.quick)
    t0 = time.perf_counter()
    vocab = int(model.config.vocab_size)
    repeats = 1 if args.quick or name == "qwen3" else args.repeats
    for kind, sizes in (("hf_dynamic", p["hf"]), ("hf_static", p["hf_static"])):
        for b in sizes:
            out[kind][b] = bench_hf(model, vocab, p, b, device, repeats, static=kind == "hf_static")
            log(name, f"{kind:11s} B={b:5d}", out[kind][b])
    for key, runs in (("vs_hf", out["engine"]), ("vs_hf_groups", out["engine_groups"])):
        out[key] = {}
        for b, e in runs.items():
            refs = [
                r[b]["tokens_per_s"]
                for r in (out["hf_dynamic"], out["hf_static"])
                if "tokens_per_s" in r.get(b, {})
            ]
            if refs:
                out[key][b] = round(e["tokens_per_s"] / max(refs), 2)
    out["bench_s"] = round(out["bench_s"] + time.perf_counter() - t0, 1)


def log(*a: Any) -> None:
    print(*[json.dumps(x) if isinstance(x, dict) else x for x in a], flush=True)


def markdown(results: dict[str, Any]) -> str:
    lines = [
        f"# Engine vs transformers `generate` ({results['device']}, {results['threads']} torch thread(s))",
        "",
    ]
    if results["device"] == "cpu":
        lines += [
            "On the CPU a decode step runs at least 4 rows (`ROW_BLOCK`: a row's numbers must "
            "not depend on its batch, and the CPU's GEMM takes another path below 4 rows), so a "
            "model whose weights do not fit the CPU's cache pays for it at B=1: its "
            "matrix-vector products become 4-row products.",
            "",
        ]
    for name, m in results["models"].items():
        lines += [f"## {name}: {m['params'] / 1e6:.2f} M parameters, {m['dtype']}, prompt {m['prompt']}, "
                  f"{m['new']} new tokens", "",
                  "| B | engine tok/s | ms/step | HF dynamic tok/s | ms/step | HF static tok/s | ms/step | engine / best HF |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for b, e in m["engine"].items():
            cells = [str(b), f"{e['tokens_per_s']:,.0f}", f"{e['ms_per_step']:.2f}"]
            for kind in ("hf_dynamic", "hf_static"):
                r = m[kind].get(b, {})
                cells += (
                    [f"{r['tokens_per_s']:,.0f}", f"{r['ms_per_step']:.2f}"]
                    if "tokens_per_s" in r
                    else ["—", "—"]
                )
            cells.append(f"{m['vs_hf'][b]:.2f}x" if b in m["vs_hf"] else "—")
            lines.append("| " + " | ".join(cells) + " |")
        groups = m.get("engine_groups") or {}
        if groups:
            lines.append("")
            lines.append("In GRPO groups of 8 rollouts per prompt: " + "; ".join(
                f"B={b}: {g['tokens_per_s']:,.0f} tok/s ({g['ms_per_step']:.2f} ms/step)"
                + (f", {m['vs_hf_groups'][b]:.2f}x the best HF" if b in m.get("vs_hf_groups", {}) else "")
                for b, g in groups.items()) + ".")  # fmt: skip
        for attention, runs in (m.get("engine_by_attention") or {}).items():
            lines.append("")
            lines.append(f"The engine with `{attention}` decode attention (this run's engine: `{m['attention']}`): " + "; ".join(
                f"B={b}: {r['tokens_per_s']:,.0f} tok/s ({r['ms_per_step']:.2f} ms/step)"
                for b, r in runs.items()) + ".")  # fmt: skip
        pf = m["prefill"]
        lines += ["", f"Prefill of a group of {pf['group']} rollouts of one {pf['prompt_tokens']}-token prompt: "
                  f"{pf['shared']['ms']:.2f} ms with prefix sharing ({pf['shared']['prefilled_tokens']} tokens "
                  f"computed), {pf['independent']['ms']:.2f} ms without ({pf['independent']['prefilled_tokens']}): "
                  f"{pf['speedup']}x."]  # fmt: skip
        if "ops_per_step" in m:
            o = m["ops_per_step"]
            lines.append(f"Ops per decode step at B={o['batch']}: {o['top']} dispatched by the step "
                         f"({o['all']} with the ops ATen runs inside them).")  # fmt: skip
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--models", default="default,gpu,qwen3")
    ap.add_argument("--quick", action="store_true", help="fewer sizes, one timed call each")
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per measurement (best)")
    ap.add_argument("--compare-attention", action="store_true",
                    help="also time the engine with the other decode attention")  # fmt: skip
    ap.add_argument("--no-graphs", action="store_true", help="CUDA: eager decode steps")
    ap.add_argument("--name", default="engine", help="results file stem")
    args = ap.parse_args()
    threads = configure_torch_threads()
    t0 = time.perf_counter()
    results: dict[str, Any] = {
        "device": args.device,
        "threads": threads,
        "quick": args.quick,
        "models": {},
    }
    if args.device.startswith("cuda"):
        results["gpu"] = torch.cuda.get_device_name()
    models = {}
    for name in args.models.split(","):  # the engine on every model first, then HF's
        results["models"][name], models[name] = bench_engine_side(name, args, args.device)
    for name, model in models.items():
        bench_hf_side(name, model, results["models"][name], args, args.device)
    results["total_s"] = round(time.perf_counter() - t0, 1)
    ratios = [r for m in results["models"].values() for r in m["vs_hf"].values()]
    results["vs_hf_median"] = statistics.median(ratios) if ratios else None
    save(args.name, results)
    (RESULTS / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))


if __name__ == "__main__":
    main()
