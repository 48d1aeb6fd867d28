"""The torch inference engine: a decode loop over preallocated KV slots, one fixed step.

``TorchEngine`` owns a causal LM of the Llama family (``roles.inference.model_runner``),
its KV cache (one slot of ``max_len`` positions per row, allocated once, sized to a
memory budget) and the state of every row, and offers the loop's moves; the async
front (``roles.inference.torch_backend.DecodeLoop``) calls them from one worker thread:

- ``add(request)``: a generate request takes the lowest free slot
  (``roles.inference.slots``, which also finds the slot already holding its prompt's
  prefix), or is answered at once (a refusal, a zero budget);
- ``start()``: the requests added since the last call get their prompts into the cache:
  shared prefixes are copied from the slot that holds them (a GRPO group's prompt is
  prefilled once), the rest of each prompt but its last token is prefilled in one padded
  pass, and each row's first input is its prompt's last token;
- ``step()``: one decode step for rows ``[0, b)``: feed each row its token, sample the
  next for all rows at once (``roles.inference.sampling``: counter-based, per-row seeds),
  advance positions, all on the device; then one copy of (tokens, logprobs) to the host,
  where stop tokens, stop strings and budgets are checked for all live rows with numpy
  and finished rows are answered and free their slots (the slot keeps its content for
  prefix reuse). ``b`` is the highest live slot + 1 rounded up to a multiple of 4, and
  ``span`` the longest row rounded up to a multiple of 16 (the CPU's kernels round a row
  differently otherwise: ``ROW_BLOCK``, ``COLUMN_BLOCK``). On CUDA the step is
  pipelined: step t+1 is launched before step t's output is read;
- ``score(requests)``: teacher-forced logprobs with the model's own forward (no cache);
- ``check_state`` / ``load_state``: verify, then swap weights in place (the caller holds
  the loop between steps with no row live), which also forgets every kept prefix.

The step is the same tensor ops whatever the batch holds, with no host sync inside: on
CUDA it is captured once per (batch bucket, length bucket, filtered) as a
``torch.cuda.CUDAGraph`` and replayed (``cuda_graphs``; ``bucket``: four shapes per
doubling of the batch or the length); on the CPU it runs eagerly at the batch and length
rounded up to 4 rows and 16 columns. Dead rows inside ``[0, b)`` (finished, or
never used) are computed and ignored; their positions stop at the slot's end.

Guarantees (``tests/unit/test_engine.py``): a request's tokens and logprobs depend only
on the request and its seed, not on the rows beside it, when it was admitted, or what
its slot held before: bitwise on the CPU with one torch thread (the inference role's
default, ``RLBUS_TORCH_THREADS``); with more threads, or on CUDA (cuBLAS picks kernels
by shape), a logprob can move in its last bits with the batch, as in any batched
engine. The logits equal the model's own forward; a prefix copied from another slot
equals one prefilled in place.

Memory: the cache takes ``slots * max_len * kv_bytes_per_token`` bytes; ``slots`` is
``max_batch_size`` unless the budget (``inference.kv_cache_gb``; by default on CUDA
what ``inference.gpu_memory_fraction`` of the GPU leaves after the weights and a
working reserve, on the CPU 2 GB) holds fewer, and a budget that holds fewer than 4
slots of ``max_len`` positions is refused at start, naming the keys to change. ``max_len`` is
``inference.max_model_len`` or the model's ``max_position_embeddings``; a request that
cannot fit in one slot is refused as ``context_too_long``.

    engine = TorchEngine.from_path("runs/x/model/initial", max_batch_size=64)
    replies = engine.generate([GenerateRequest(request_id="r", prompt_ids=..., seed=1)])
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import torch

from roles.inference import sampling
from roles.inference.backend import admit_generate, admit_score, check_finite
from roles.inference.capacity import (
    CPU_KV_BYTES,
    ROW_BLOCK,
    kv_bytes_per_token,
    plan_slots,
    round_up,
)
from roles.inference.model_runner import DecoderRunner
from roles.inference.slots import SlotTable
from roles.inference.torch_setup import configure_torch_threads, default_stop_ids, limit_gpu_memory
from roles.lib.model import serving_dtype
from roles.lib.model.broadcast import BROADCAST_KIND, BroadcastReceiver, Rendezvous
from roles.lib.model.loading import load_model, load_tokenizer, resolve_device
from roles.lib.model.shared_weights import Layout, SharedReader
from roles.lib.model.weights import (
    adapter_scale,
    load_state_bytes,
    state_to_load,
    tied_keys,
    verified,
)
from schemas import (
    GenerateRequest,
    GenerateResult,
    InferenceFailed,
    ObjectRef,
    ScoreRequest,
    ScoreResult,
)
from schemas.arrays import pack_f32, pack_i32

Reply = GenerateResult | ScoreResult | InferenceFailed

GPU_RESERVE = 0.10  # share of inference's GPU memory kept for activations and graphs
PREFILL_TOKENS = 8192  # most (padded) tokens one prefill pass takes
GRAPH_COLUMNS = 64  # CUDA graphs: length buckets are multiples of this (``bucket``)
BROADCAST_WAIT_S = 10.0  # how long a replica waits for a broadcast version announced


def bucket(n: int, smallest: int, largest: int) -> int:
    """``n`` rounded up to a CUDA graph's shape: a multiple of ``smallest``, and of a
    quarter of ``n``'s power of two above that (4 buckets per doubling: at most ~25% of
    padding, and few graphs); capped at ``largest``."""
    step = max(smallest, 1 << max(0, n.bit_length() - 3))
    return min(-(-n // step) * step, largest)


def _versions(
    first: int, swaps: Sequence[tuple[int, int]], n: int
) -> tuple[int, list[tuple[int, int]]]:
    """A completion of ``n`` tokens admitted under version ``first``, with ``swaps``
    (token index from which a version sampled): the version of its first token and the
    later spans (``GenerateResult.version_spans``), each version that sampled nothing
    left out."""
    spans: list[tuple[int, int]] = []
    for at, v in swaps:
        if at >= n:
            break
        if at == 0:
            first = v
        elif spans and spans[-1][0] == at:
            spans[-1] = (at, v)
        elif v != (spans[-1][1] if spans else first):
            spans.append((at, v))
    return first, spans


@dataclasses.dataclass
class EngineStats:
    """Cumulative counters, written by the worker thread, read by metrics."""

    generate_requests: int = 0
    score_requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    scored_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed (the rest were shared or fed)
    shared_tokens: int = 0  # prompt tokens whose keys and values came from another slot
    steps: int = 0
    compute_s: float = 0.0


@dataclasses.dataclass
class _Launched:
    """A decode step in flight: the live rows it computes for (slots, and which admission
    of each slot), its batch, where its output lands on the host, and when it has."""

    idx: np.ndarray
    gen: np.ndarray
    b: int
    buffer: int  # which host buffer its output lands in
    event: Any


@dataclasses.dataclass
class Row:
    """One admitted generate request while it decodes."""

    req: GenerateRequest
    prompt: list[int]
    slot: int
    max_new: int
    stop_strings: tuple[str, ...]
    version: int
    admitted: float  # perf_counter at admission
    queue_s: float = 0.0  # set by the loop: time from submit to admission
    source: int | None = None  # the slot its prefix is copied from
    shared: int = 0  # prompt tokens it shares with ``source``
    pending: bool = True  # added, not yet started (prefix not in the cache)
    tag: Any = None  # the caller's handle (the loop's pending future)
    # Swaps while it decoded (``swap_in_flight``): (first token index, version).
    spans: list[tuple[int, int]] = dataclasses.field(default_factory=list)


class TorchEngine:
    """A causal LM's decode loop over KV slots (module docstring); one thread at a time."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any | None = None,
        *,
        stop_token_ids: Sequence[int] | None = None,
        policy_version: int = 0,
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        kv_cache_bytes: int | None = None,
        cuda_graphs: bool = True,
        share_prefixes: bool = True,
        pipeline: bool | None = None,
        attention: str | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        cfg = model.config
        self.vocab_size = int(model.get_input_embeddings().num_embeddings)
        self.max_len = int(
            min(cfg.max_position_embeddings, max_model_len or cfg.max_position_embeddings)
        )
        pad = getattr(tokenizer, "pad_token_id", None) if tokenizer is not None else None
        if pad is None:
            pad = getattr(cfg, "pad_token_id", None)
        self.pad_id = int(pad) if pad is not None else 0
        if stop_token_ids is None:
            stop_token_ids = default_stop_ids(tokenizer) if tokenizer is not None else []
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._version = policy_version
        self.stats = EngineStats()
        self._keep_arg = "logits_to_keep" in inspect.signature(model.forward).parameters
        dtype = next(model.parameters()).dtype
        n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        per_token = kv_bytes_per_token(cfg.num_hidden_layers, n_kv, head_dim, dtype.itemsize)
        budget = kv_cache_bytes if kv_cache_bytes is not None else default_kv_budget(self.device)
        self.asked_rows = max_batch_size
        self.max_rows = plan_slots(max_batch_size, round_up(self.max_len), per_token, budget)
        self.n_slots = round_up(self.max_rows, ROW_BLOCK)
        if attention is None:  # (``DecoderRunner._decode_attention``) the CPU's is the same
            # whatever the batch: a row's numbers must not depend on it
            attention = "auto" if self.device.type == "cuda" else "sdpa"
        self.runner = DecoderRunner(
            model, slots=self.n_slots, max_len=self.max_len, attention=attention
        )
        self.slots = SlotTable(self.max_rows, share_prefixes=share_prefixes)
        dev, n = self.device, self.n_slots
        # Per-slot sampling state on the device (written at admission, read by the step),
        # each row's uniform draw for the step (written by the host before it) and the
        # step's output (token, logprob).
        self.params = sampling.RowParams.of([1.0] * n, device=dev)
        self.u = torch.zeros(n, 1, dtype=torch.float64, device=dev)
        self.out = torch.zeros(2, n, dtype=torch.float64, device=dev)
        # Host mirrors: what the step needs to pick its shape, and each row's output.
        self.rows: list[Row | None] = [None] * n
        self.h_key = np.zeros(n, dtype=np.uint64)  # each row's random stream
        # Host buffers, two of each on CUDA: step k's draws are written to and its output
        # read from buffer k % 2, whose previous copies (step k - 2's) are done by then
        # (pipelined: step k is launched before step k - 1's output is read).
        pin = dev.type == "cuda"
        self._u_host = (
            [self.u] * 2
            if not pin
            else [torch.zeros_like(self.u, device="cpu").pin_memory() for _ in range(2)]
        )
        self._out_host = [torch.zeros(2, n, dtype=torch.float64, pin_memory=pin) for _ in range(2)]
        self._u_np = [t.numpy()[:, 0] for t in self._u_host]  # (numpy views, made once)
        self._out_np = [t.numpy() for t in self._out_host]
        self.h_pos = np.zeros(n, dtype=np.int64)  # position of the token fed next
        self.h_count = np.zeros(n, dtype=np.int64)  # tokens launched (the next draw's index)
        self.h_done = np.zeros(n, dtype=np.int64)  # tokens read back
        self.h_gen = np.zeros(n, dtype=np.int64)  # admissions into the slot (whose row it is)
        self.h_max_new = np.zeros(n, dtype=np.int64)
        self.h_live = np.zeros(n, dtype=bool)
        self.h_filtered = np.zeros(n, dtype=bool)
        self.h_stops = np.full((n, 1), -1, dtype=np.int64)  # each row's stop ids, -1 padded
        self.h_out_tok = np.zeros((n, self.max_len), dtype=np.int64)
        self.h_out_lp = np.zeros((n, self.max_len), dtype=np.float32)
        self._added: list[Row] = []
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.pipeline = self.device.type == "cuda" if pipeline is None else pipeline
        self._pending: _Launched | None = None
        self._graphs: dict[tuple[int, int, bool], Any] = {}
        self._pool: Any = None
        self._heads: dict[int, tuple[Any, ...]] = {}
        self._io_views: dict[tuple[int, int], tuple[Any, ...]] = {}
        self._shared: SharedReader | None = None  # the trainer's ring (weights_via = "ipc")
        self._receiver: BroadcastReceiver | None = None  # weights_via = "broadcast"
        self._staged: torch.Tensor | None = None  # the version stage_shared verified
        self._stage_stream: Any = None

    @classmethod
    def from_path(
        cls,
        path: str | Path,
        *,
        device: str = "auto",
        dtype: str = "float32",
        local_files_only: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        gpu_memory_fraction: float | None = None,
        served_dtype: str = "auto",
        max_batch_size: int = 64,
        max_model_len: int | None = None,
        kv_cache_gb: float | None = None,
        cuda_graphs: bool = True,
        graphs_at_start: int = 0,
    ) -> TorchEngine:
        """Load the model for serving: ``serving_dtype`` and the memory cap on CUDA; with
        CUDA graphs, the first ``graphs_at_start`` step shapes captured before it returns
        (``capture_graphs``)."""
        configure_torch_threads()
        dev = resolve_device(device)
        limit_gpu_memory(dev, gpu_memory_fraction)  # before the first allocation
        model = load_model(
            path,
            dtype=serving_dtype(dtype, dev, served_dtype),
            device=dev,
            local_files_only=local_files_only,
        )
        tokenizer = load_tokenizer(path, local_files_only=local_files_only)
        budget = None
        if kv_cache_gb is not None:
            budget = int(kv_cache_gb * 2**30)
        elif dev.startswith("cuda"):
            budget = gpu_kv_budget(torch.device(dev), gpu_memory_fraction)
        engine = cls(
            model,
            tokenizer,
            stop_token_ids=stop_token_ids,
            max_batch_size=max_batch_size,
            max_model_len=max_model_len,
            kv_cache_bytes=budget,
            cuda_graphs=cuda_graphs,
        )
        engine.capture_graphs(graphs_at_start)
        return engine

    def describe(self) -> dict[str, Any]:
        """What the engine is serving with (for the role's start-up log line)."""
        return {
            "device": str(self.device),
            "dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
            "rows": self.max_rows,
            "rows_asked": self.asked_rows,
            "kv_cache_gb": round(
                self.runner.cache.numel() * self.runner.cache.element_size() / 2**30, 3
            ),
            "cuda_graphs": self.cuda_graphs,
            "graphs_captured": len(self._graphs),
            "attention": self.runner.attention,
        }

    # -- weights ------------------------------------------------------------------------

    @property
    def policy_version(self) -> int:
        """The version of the weights serving; setting another (the weights changed in
        place, as a synchronous loop's trainer changes them) forgets kept prefixes."""
        return self._version

    @policy_version.setter
    def policy_version(self, version: int) -> None:
        if version != self._version:
            self.slots.forget()
        self._version = version

    def check_state(self, data: bytes, expected_digest: str) -> dict[str, torch.Tensor]:
        """``data`` decoded (an adapter blob: the layers it adapts, merged), once it has the
        announced digest, fits this model exactly and is finite everywhere (``WeightsNotFinite`` names the first tensor that is not).

        Run before holding the loop: a bad blob is refused without touching the model, so
        a half-copied or NaN state dict can never serve.
        """
        state = state_to_load(self.model, verified(data, expected_digest))
        own = self.model.state_dict()
        expected = {k: tuple(v.shape) for k, v in own.items() if k not in tied_keys(own)}
        if adapter_scale(data) is not None:  # merged layers only: the others stay as they are
            expected = {k: v for k, v in expected.items() if k in state}
        got = {k: tuple(v.shape) for k, v in state.items()}
        if got != expected:
            missing = sorted(set(expected) - set(got))
            unexpected = sorted(set(got) - set(expected))
            reshaped = sorted(k for k in set(got) & set(expected) if got[k] != expected[k])
            raise ValueError(
                f"weights do not fit the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}, wrong shape {reshaped[:5]}"
            )
        check_finite(state.items())
        return state

    def load_state(self, data: bytes, expected_digest: str, version: int) -> None:
        """Copy the weights in and set the version (no row may be live).

        ``load_state_dict`` copies into the model's own parameters, in place: the
        runner's fused buffers (which those parameters are views of) and every captured
        graph see the new weights at the same addresses; each tensor is cast to the
        serving dtype as ``.to()`` would (float32 masters land in bfloat16 on CUDA). Kept
        prefixes are forgotten: their keys and values came from the old weights.
        """
        if self.live:
            raise RuntimeError(f"weights swap with {self.live} rows live")
        self.flush()  # a step still in flight computed only rows already answered
        with torch.no_grad():
            load_state_bytes(self.model, data, expected_digest)
        self.slots.forget()
        self._version = version

    def stage_shared(self, ref: ObjectRef) -> torch.Tensor:
        """Copy the version ``ref`` names into this engine's staging buffer and verify
        it (layout, device digest, every value finite): out of the trainer's shared ring
        (kind "ipc"), or as received from the trainer's broadcast (kind "broadcast": joins
        its session first, waits for the version at most ``BROADCAST_WAIT_S``). From any
        thread, while the loop decodes (on CUDA on a stream of its own)."""
        if self._shared is None:
            self._shared = SharedReader(Layout.of(self.model.state_dict()), self.device)
        with self._staging_stream():
            if ref.kind == BROADCAST_KIND:
                if self._receiver is None:
                    self._receiver = BroadcastReceiver(self._shared.layout, self.device)
                dtype = msgspec.json.decode(ref.location, type=Rendezvous).dtype
                into = self._shared.staging(dtype)
                staged = self._receiver.receive(ref, into, timeout_s=BROADCAST_WAIT_S)
            else:
                staged = self._shared.read(ref)  # (its digest's .tolist() waits for the copy)
            if not bool(torch.isfinite(staged).all()):
                check_finite(self._shared.layout.views(staged).items())  # names the tensor
        self._shared.bind(self.model, staged)  # not in the swap's pause
        self._staged = staged
        return staged

    def stage_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` (what ``check_state`` returned) moved to the model's device and dtype,
        off the loop (on CUDA on the staging stream), so that an in-flight swap copies
        device to device: the host-to-device copy is not in the pause."""
        own = self.model.state_dict()
        with self._staging_stream():
            with torch.no_grad():
                staged = {k: v.to(own[k].device, own[k].dtype) for k, v in state.items()}
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
        return staged

    @contextlib.contextmanager
    def _staging_stream(self) -> Iterator[None]:
        """(a worker thread) This engine's device current, and on CUDA its staging stream."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.set_device(self.device)  # (a worker thread has no current device)
        if self._stage_stream is None:
            self._stage_stream = torch.cuda.Stream(self.device)
        with torch.cuda.stream(self._stage_stream):
            yield

    def load_staged(self, model: torch.nn.Module) -> None:
        """Copy the version ``stage_shared`` verified into ``model`` (one fused copy)."""
        assert self._shared is not None and self._staged is not None
        self._shared.load_into(model, self._staged)

    def swap_in_flight(self, load: Callable[[torch.nn.Module], None], version: int) -> None:
        """Load new weights between two steps while rows decode (``inference.swap =
        "in_flight"``): ``load(model)`` copies them into the model's parameters in place.

        Rows added but not started are prefilled first, under the old weights, so every
        live row's keys and values so far are the old version's; each live row records
        from which token on the new version samples (``Row.spans``: with a step in flight,
        the one after it), and its slot is not kept as a prefix when it finishes (its keys
        and values mix versions). Every kept prefix is forgotten, the live rows' too.
        """
        if self._added:
            self.start()
        with torch.no_grad():
            load(self.model)
        for row in self.rows:
            if row is not None:
                row.spans.append((int(self.h_count[row.slot]), version))
        self.slots.forget(live_too=True)
        self._version = version

    # -- admission ----------------------------------------------------------------------

    @property
    def live(self) -> int:
        return int(self.h_live.sum())

    @property
    def free(self) -> int:
        return self.slots.free

    def add(self, req: GenerateRequest, now: float | None = None) -> Row | Reply:
        """Admit ``req`` into a free slot (the caller checked ``free``); or its answer now:
        a refusal, or an empty completion for a zero budget."""
        admitted = admit_generate(req, vocab_size=self.vocab_size, max_model_len=self.max_len)
        if isinstance(admitted, InferenceFailed):
            self.stats.failed_requests += 1
            return admitted
        prompt, budget = admitted
        stops = tuple(x for x in req.sampling.stop if x)
        if stops and self.tokenizer is None:
            self.stats.failed_requests += 1
            return InferenceFailed(
                request_id=req.request_id,
                kind="bad_request",
                message="stop strings need a tokenizer; send stop_token_ids",
            )
        if budget == 0:
            self._count(len(prompt), 0)
            return GenerateResult(
                request_id=req.request_id,
                completion_ids=pack_i32([]),
                logprobs=pack_f32([]),
                finish_reason="length",
                policy_version=self.policy_version,
                prompt_tokens=len(prompt),
            )
        place = self.slots.place(prompt)
        row = Row(
            req=req,
            prompt=prompt,
            slot=place.slot,
            max_new=budget,
            stop_strings=stops,
            version=self.policy_version,
            admitted=time.perf_counter() if now is None else now,
            source=place.source,
            shared=place.shared,
        )
        s = place.slot
        self.rows[s] = row
        self.h_live[s] = True
        self.h_pos[s] = len(prompt) - 1
        self.h_count[s] = self.h_done[s] = 0
        self.h_gen[s] += 1
        self.h_max_new[s] = budget
        sp = req.sampling
        self.h_filtered[s] = sampling.filters(sp.temperature, sp.top_k, sp.top_p)
        stop_ids = sorted(self.stop_token_ids | set(req.stop_token_ids))
        if len(stop_ids) > self.h_stops.shape[1]:
            wider = np.full((self.n_slots, len(stop_ids)), -1, dtype=np.int64)
            wider[:, : self.h_stops.shape[1]] = self.h_stops
            self.h_stops = wider
        self.h_stops[s] = -1
        self.h_stops[s, : len(stop_ids)] = stop_ids
        self._added.append(row)
        return row

    def start(self) -> None:
        """Put the prompts of the rows added since the last call into the cache: copy
        shared prefixes, prefill the rest but each prompt's last token (module docstring)."""
        rows, self._added = self._added, []
        if not rows:
            return
        by_slot = {r.slot: r for r in rows}
        # A row whose source is itself pending waits for that row's prefill (a group
        # admitted in one round: the first is prefilled, the others copy it).
        gen: dict[int, int] = {}

        def generation(r: Row) -> int:
            if r.slot not in gen:
                src = by_slot.get(r.source) if r.source is not None and r.source != r.slot else None
                gen[r.slot] = 0 if src is None else generation(src) + 1
            return gen[r.slot]

        with torch.inference_mode():
            for g in sorted({generation(r) for r in rows}):
                wave = [r for r in rows if gen[r.slot] == g]
                self.runner.copy_prefix(
                    [(r.source, r.slot, r.shared) for r in wave if r.source is not None]
                )
                todo = [(r.slot, r.shared, r.prompt[r.shared : len(r.prompt) - 1]) for r in wave]
                self._prefill([t for t in todo if t[2]])
                for r in wave:
                    self.stats.shared_tokens += r.shared if r.source is not None else 0
            self._init_rows(rows)
        self.slots.settle()
        for r in rows:
            r.pending = False

    def _prefill(self, todo: list[tuple[int, int, list[int]]]) -> None:
        """Prefill in passes of at most ``PREFILL_TOKENS`` padded tokens."""
        todo.sort(key=lambda t: len(t[2]))
        i = 0
        while i < len(todo):
            j = i + 1
            while j < len(todo) and (j + 1 - i) * len(todo[j][2]) <= PREFILL_TOKENS:
                j += 1
            self.runner.prefill(todo[i:j])
            self.stats.prefilled_tokens += sum(len(t[2]) for t in todo[i:j])
            i = j

    def _init_rows(self, rows: list[Row]) -> None:
        """Each new row's first input (its prompt's last token) and sampling state."""
        dev = self.device
        slots = [r.slot for r in rows]
        idx = torch.tensor(slots, device=dev)
        s = [r.req.sampling for r in rows]
        new = sampling.RowParams.of(
            [x.temperature for x in s], [x.top_k for x in s], [x.top_p for x in s], dev
        )
        self.params.put(idx, new)
        self.runner.tokens[idx] = torch.tensor([r.prompt[-1] for r in rows], device=dev)
        self.runner.pos[idx] = torch.tensor([len(r.prompt) - 1 for r in rows], device=dev)
        self.h_key[slots] = sampling.row_keys([r.req.seed for r in rows])

    def drop(self, row: Row) -> None:
        """Give up a live row (its caller has gone): free its slot, which keeps its prompt
        (a pending row is started first: rows added after it may copy its prefix)."""
        if self.rows[row.slot] is not row:
            return
        if row.pending:
            self.start()
        self._free_slot(row.slot, row.prompt[:-1])

    def _free_slot(self, slot: int, content: Sequence[int]) -> None:
        self.rows[slot] = None
        self.h_live[slot] = False
        self.slots.release(slot, content)

    # -- the step -----------------------------------------------------------------------

    def shape(self) -> tuple[int, int, bool]:
        """(b, span, filtered) of the next step: rows [0, b), columns [0, span), whether any
        live row needs the top-k/top-p sort."""
        live = self.h_live
        top = int(np.flatnonzero(live)[-1]) + 1
        longest = int(self.h_pos[live].max()) + 1
        filtered = bool(self.h_filtered[live].any())
        if self.device.type == "cuda":  # few shapes: one graph each (eager: the same shapes)
            return self._graph_shape(top, longest, filtered)
        return round_up(top, ROW_BLOCK), round_up(longest), filtered

    def _graph_shape(self, top: int, longest: int, filtered: bool) -> tuple[int, int, bool]:
        """The CUDA step's shape for ``top`` rows and ``longest`` columns (``bucket``)."""
        return (
            bucket(top, ROW_BLOCK, self.n_slots),
            bucket(longest, GRAPH_COLUMNS, self.runner.width),
            filtered,
        )

    def graph_shapes(self, filtered: bool = False) -> list[tuple[int, int, bool]]:
        """Every shape ``shape`` can give on CUDA (with ``filtered`` as given), shortest
        columns first, then fewest rows: what ``capture_graphs`` captures, in order."""
        rows = sorted({bucket(t, ROW_BLOCK, self.n_slots) for t in range(1, self.n_slots + 1)})
        width = self.runner.width
        cols = sorted({bucket(n, GRAPH_COLUMNS, width) for n in range(1, width + 1)})
        return [(b, span, filtered) for span in cols for b in rows]

    def capture_graphs(self, most: int) -> int:
        """Capture the step's CUDA graph now (the engine idle, no row live) at up to
        ``most`` unfiltered shapes, in ``graph_shapes`` order, so that no request and no
        weights swap waits for a capture mid-run: a shape is otherwise captured by the
        step that first needs it (tens of ms each), and a run's first generation meets a
        score of new shapes. The rest (longer lengths, top-k/top-p) capture on first use.
        Returns the graphs held (0 without CUDA graphs)."""
        if not self.cuda_graphs:
            return 0
        with torch.inference_mode():
            for key in self.graph_shapes()[:most]:
                self._graph(key)
        return len(self._graphs)

    def _head(self, b: int) -> tuple[Any, ...]:
        """Views of rows [0, b) of the step's state (made once per b)."""
        views = self._heads.get(b)
        if views is None:
            tokens, pos, _ = self.runner._head(b)
            views = (self.params.head(b), self.u[:b], self.out[0, :b], self.out[1, :b], tokens, pos)
            self._heads[b] = views
        return views

    def _io(self, b: int, k: int) -> tuple[Any, ...]:
        """Views of rows [0, b) for the host copies through buffer ``k``: the device's
        draws and the host's (None on the CPU: the same tensor), the step's output and its
        host copy (made once per b)."""
        views = self._io_views.get((b, k))
        if views is None:
            u_host = self._u_host[k]
            views = (
                self.u[:b],
                None if u_host is self.u else u_host[:b],
                self.out[:, :b],
                self._out_host[k][:, :b],
            )
            self._io_views[(b, k)] = views
        return views

    def _step_fn(self, b: int, span: int, filtered: bool) -> None:
        """The step on the device: decode, sample, advance (no host sync)."""
        params, u, out_tok, out_lp, tokens, pos = self._head(b)
        logits = self.runner.decode(b, span)
        tok, lp = sampling.sample(logits, params, u, filtered=filtered)
        out_tok.copy_(tok)
        out_lp.copy_(lp)
        tokens.copy_(tok)
        pos.add_(1).clamp_(max=self.max_len - 1)

    def _graph(self, key: tuple[int, int, bool]) -> Any:
        """The CUDA graph of the step of shape ``key``, captured on first use (or before
        serving: ``capture_graphs``).

        Capturing needs warm-up runs, which execute: they write each row's keys and
        values for its current token at its current position (what the real step will
        write there) and advance the step's state, which is restored afterwards.
        """
        graph = self._graphs.get(key)
        if graph is not None:
            return graph
        state = (self.runner.tokens, self.runner.pos, self.out)
        saved = [t.clone() for t in state]

        def restore() -> None:
            for t, s in zip(state, saved, strict=True):
                t.copy_(s)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step_fn(*key)
                restore()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a weights version staged on another thread meanwhile
        # (``stage_shared``, on a stream of its own) does not break the capture.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._step_fn(*key)
        restore()
        self._graphs[key] = graph
        return graph

    def step(self) -> list[tuple[Row, GenerateResult]]:
        """One decode step of every live row; the rows it finished, with their answers.

        Pipelined (``pipeline``, on CUDA by default): the step is launched, then the
        previous step's output is read and answered while the device computes, so the host
        never leaves the device idle. A row is then answered one step after its last token,
        and that step computes it once more for nothing; a row's tokens are the same either
        way (``tests/unit/test_engine.py``).
        """
        if self._added:
            self.start()
        launched = self._launch() if self.h_live.any() else None
        finished = self._collect(self._pending) if self._pending is not None else []
        self._pending = launched
        if launched is not None and not self.pipeline:
            finished += self._collect(launched)
            self._pending = None
        return finished

    def flush(self) -> list[tuple[Row, GenerateResult]]:
        """Read the step still in flight, if any (pipelined): what it finished."""
        pending, self._pending = self._pending, None
        return self._collect(pending) if pending is not None else []

    def _launch(self) -> _Launched:
        """Start one decode step of rows [0, b) (the device works on; nothing waits)."""
        start = time.perf_counter()
        b, span, filtered = self.shape()
        idx = np.flatnonzero(self.h_live[:b])
        k = self.stats.steps % 2
        u_dev, u_host, out, out_host = self._io(b, k)
        self._u_np[k][:b] = sampling.uniforms(self.h_key[:b], self.h_count[:b])
        event = None
        with torch.inference_mode():
            if u_host is not None:
                u_dev.copy_(u_host, non_blocking=True)
            if self.cuda_graphs:
                self._graph((b, span, filtered)).replay()
            else:
                self._step_fn(b, span, filtered)
            out_host.copy_(out, non_blocking=True)  # the step's one copy
            if self.device.type == "cuda":
                event = torch.cuda.Event()
                event.record()
        self.stats.steps += 1
        self.h_count[idx] += 1
        self.h_pos[idx] = np.minimum(self.h_pos[idx] + 1, self.max_len - 1)
        self.stats.compute_s += time.perf_counter() - start
        return _Launched(idx, self.h_gen[idx].copy(), b, k, event)

    def _collect(self, step: _Launched) -> list[tuple[Row, GenerateResult]]:
        """Read a launched step's tokens and logprobs into its rows (those still live:
        a row answered meanwhile, and any row admitted into its slot since, are not its);
        answer the rows it finished (a stop token or string, or the budget)."""
        start = time.perf_counter()
        if step.event is not None:
            step.event.synchronize()
        out = self._out_np[step.buffer][:, : step.b]
        mine = self.h_live[step.idx] & (self.h_gen[step.idx] == step.gen)
        idx = step.idx[mine]
        tok, lp = out[0, idx].astype(np.int64), out[1, idx].astype(np.float32)
        n = self.h_done[idx]
        self.h_out_tok[idx, n] = tok
        self.h_out_lp[idx, n] = lp
        self.h_done[idx] += 1
        stopped = (self.h_stops[idx] == tok[:, None]).any(axis=1)
        done = stopped | (self.h_done[idx] >= self.h_max_new[idx])
        finished: list[tuple[Row, GenerateResult]] = []
        now = time.perf_counter()
        for slot, stop, end in zip(idx.tolist(), stopped.tolist(), done.tolist(), strict=True):
            row = self.rows[slot]
            assert row is not None
            if not end and row.stop_strings and self._hit_stop_string(row):
                stop = end = True
            if end:
                finished.append((row, self._finish(row, "stop" if stop else "length", now)))
        self.stats.compute_s += time.perf_counter() - start
        return finished

    def _hit_stop_string(self, row: Row) -> bool:
        """Whether the completion's text now contains one of the row's stop strings.

        Checked every step, so the first hit is caught on the token that completes it;
        only a tail of the completion is decoded (a token is at least one character for
        the tokenizers we serve, so ``len(stop) + 2`` tokens cover the string).
        """
        n = int(self.h_done[row.slot])
        tail = max(len(x) for x in row.stop_strings) + 2
        ids = self.h_out_tok[row.slot, max(0, n - tail) : n].tolist()
        text = self.tokenizer.decode(ids, skip_special_tokens=False)  # type: ignore[union-attr]
        return any(x in text for x in row.stop_strings)

    def _finish(self, row: Row, reason: str, now: float) -> GenerateResult:
        s = row.slot
        n = int(self.h_done[s])
        ids = self.h_out_tok[s, :n]
        version, spans = _versions(row.version, row.spans, n)
        self._free_slot(s, [] if row.spans else row.prompt + ids[:-1].tolist())
        self._count(len(row.prompt), n)
        return GenerateResult(
            request_id=row.req.request_id,
            completion_ids=pack_i32(ids.tolist()),
            logprobs=pack_f32(self.h_out_lp[s, :n].tolist()),
            finish_reason=reason,
            policy_version=version,
            prompt_tokens=len(row.prompt),
            queue_s=row.queue_s,
            compute_s=now - row.admitted,
            version_spans=spans,
        )

    def _count(self, prompt: int, completion: int) -> None:
        self.stats.generate_requests += 1
        self.stats.prompt_tokens += prompt
        self.stats.completion_tokens += completion

    # -- whole requests (tests, benchmarks, the synchronous GRPO baseline) ---------------

    def generate(self, reqs: Sequence[GenerateRequest]) -> list[Reply]:
        """Answer ``reqs`` in order: admitted as slots free up, decoded to the end."""
        out: list[Reply | None] = [None] * len(reqs)
        todo = list(enumerate(reqs))[::-1]
        while todo or self.live:
            while todo and self.free:
                i, req = todo.pop()
                row = self.add(req)
                if isinstance(row, Row):
                    row.tag = i
                else:
                    out[i] = row
            for row, result in self.step():
                out[row.tag] = result
        self.flush()  # a step computed after the last row ended: nothing of its is read
        return [r for r in out if r is not None]

    def run_batch(self, reqs: list[GenerateRequest | ScoreRequest]) -> list[Reply]:
        """Answer a mixed list of generate and score requests, in order."""
        out: list[Reply | None] = [None] * len(reqs)
        gen = [i for i, r in enumerate(reqs) if isinstance(r, GenerateRequest)]
        scr = [i for i, r in enumerate(reqs) if isinstance(r, ScoreRequest)]
        for i, reply in zip(scr, self.score([reqs[i] for i in scr]), strict=True):  # type: ignore[misc]
            out[i] = reply
        for i, reply in zip(gen, self.generate([reqs[i] for i in gen]), strict=True):  # type: ignore[misc]
            out[i] = reply
        return [r for r in out if r is not None]

    # -- score --------------------------------------------------------------------------

    def score(self, reqs: Sequence[ScoreRequest]) -> list[Reply]:
        """Logprobs of ``token_ids[start:]`` for each request (the model's own forward)."""
        version = self.policy_version
        replies: list[Reply | None] = [None] * len(reqs)
        todo: list[tuple[int, list[int]]] = []
        for i, req in enumerate(reqs):
            ids = admit_score(req, vocab_size=self.vocab_size, max_model_len=self.max_len)
            if isinstance(ids, InferenceFailed):
                replies[i] = ids
                self.stats.failed_requests += 1
            else:
                todo.append((i, ids))
        if todo:
            start = time.perf_counter()
            with torch.inference_mode():
                lps_all = self._score_logprobs(reqs, todo)
            for (i, _), lps in zip(todo, lps_all, strict=True):
                replies[i] = ScoreResult(
                    request_id=reqs[i].request_id, logprobs=pack_f32(lps), policy_version=version
                )
                self.stats.scored_tokens += len(lps)
            self.stats.score_requests += len(todo)
            self.stats.compute_s += time.perf_counter() - start
        return [r for r in replies if r is not None]

    def _score_logprobs(
        self, reqs: Sequence[ScoreRequest], todo: list[tuple[int, list[int]]]
    ) -> list[np.ndarray]:
        dev = self.device
        width = max(len(ids) for _, ids in todo)
        ids_t = torch.full((len(todo), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(todo), width), dtype=torch.long)
        for b, (_, ids) in enumerate(todo):
            ids_t[b, width - len(ids) :] = torch.tensor(ids)
            mask[b, width - len(ids) :] = 1
        ids_t, mask = ids_t.to(dev), mask.to(dev)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        # Rows end at the last column (left padding): the logits we need are the last
        # `span` columns, where span covers the longest scored tail plus its predictor.
        span = max(len(ids) - reqs[i].start for i, ids in todo) + 1
        keep = {"logits_to_keep": span} if self._keep_arg else {}
        logits = self.model(
            input_ids=ids_t, attention_mask=mask, position_ids=pos, use_cache=False, **keep
        ).logits[:, -span:, :]
        out = []
        for b, (i, ids) in enumerate(todo):
            n, s = len(ids) - reqs[i].start, reqs[i].start
            t = reqs[i].temperature if reqs[i].temperature > 0 else 1.0
            # logits column -span + k predicts the token at column width - span + k + 1.
            pred = logits[b, span - n - 1 : span - 1, :].float() / t
            target = torch.tensor(ids[s:], device=dev)
            lps = pred.log_softmax(-1).gather(-1, target[:, None]).squeeze(-1)
            out.append(lps.cpu().numpy().astype(np.float32))
        return out


def default_kv_budget(device: torch.device) -> int:
    """The KV budget when none is given: the CPU's, or on CUDA what the GPU has free."""
    if device.type == "cuda":
        return gpu_kv_budget(device, None)
    return CPU_KV_BYTES


def gpu_kv_budget(device: torch.device, fraction: float | None) -> int:
    """Bytes of KV cache inference may take on ``device``: its share of the GPU
    (``fraction``, else all of it) less what it holds already (the weights) and a reserve
    of ``GPU_RESERVE`` of that share for activations and graphs."""
    total = torch.cuda.get_device_properties(device).total_memory
    share = total * (fraction if fraction is not None else 1.0)
    return int(share * (1 - GPU_RESERVE) - torch.cuda.memory_allocated(device))
