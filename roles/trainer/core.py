"""The trainer's pure state machine: a fold of ``BatchAssembled`` events over a model.

No NATS here: the trainer role drives it from the bus, and a replay command can drive
it from a recorded log. Its state after batch ``s`` (weights, AdamW moments, ``step``)
depends only on the config, the initial weights and batches ``1..s``, bit for bit on
CPU: each step runs with torch seeded from ``stable_seed(cfg.seed, "trainer", step)``
inside ``fork_rng`` (no global RNG leaks in or out), deterministic algorithms on, and a
fixed intra-op thread count (``RLBUS_TORCH_THREADS``, default 1: float sums depend on
how work is split across threads). The learning rate is a pure function of the step
(``lr_at``), so the "scheduler" needs no state beyond ``step``.

Two kinds of step train nothing, and both still count as a step (``step`` moves on, the
weights stay as they were, so the trainer announces them unchanged as that version and
the run goes on): a **refused** batch, one holding a sample ``Sample.problem`` refuses
(or an unknown phase): ``train_step`` raises ``bus.errors.Rejected`` naming the step,
the sample and the problem before anything is trained, and the caller steps over it
with ``refuse_step`` (metrics ``refused_batch=1``); and a **non-finite** step, whose
loss or gradient norm (over the whole batch, on every rank) is a NaN or an infinity: no
optimizer step, the gradients are dropped, and its metrics say ``nonfinite_step=1``
with the loss. Both are pure functions of the batch, so a restart and a replay step
over exactly the same batches and reach the same weights.

A micro-batch is a set of whole samples, or, with ``trainer.shared_prefix``, samples that
share a prompt (a GRPO group's; ``roles.trainer.packing``), which run it once: a forward
over the prefixes gives their keys and values, which each sample's rest then reads as a
KV cache (``_forward``). Only the rests' logits reach the loss; their loss positions are
exactly the whole samples' (a prefix trains nothing), so the loss, its denominators and
every stat are those of whole rows up to float rounding, and the step is as
deterministic. It needs a model whose forward takes a cache (``cache_kwargs``) and one
rank (``shares_prefixes``); samples that share nothing train as whole rows. ``tokens``
counts the samples' tokens, ``computed_tokens`` the tokens the model ran, which
``flops_per_s`` and ``mfu`` count.

With ``trainer.lora`` the model is wrapped with LoRA adapters (``roles.lib.model.lora``):
AdamW steps only the adapters (and ``modules_to_save``), and the weights this fold
publishes and checkpoints are those alone (``weights_bytes``), drawn at start from a seed
of their own, so the fold stays a pure function of config, initial weights and batches.

A checkpoint is a snapshot of the fold: ``<run_dir>/checkpoints/step-<8 digits>/`` with
``model.safetensors``, ``optimizer.pt`` and ``state.json`` (step, weights digest, the
caller's ``extra``). It is written to a temporary sibling and renamed into place, so a
crash never leaves a half checkpoint. Which stay is ``checkpoints_to_delete``: the newest
``trainer.keep_checkpoints``, and for good every one whose step is a multiple of
``trainer.checkpoint_keep_every`` (so a run's early policies can still be evaluated or
exported after it moved on).

    core = TrainerCore(cfg, "runs/x/model/initial")
    for batch in batches:                 # steps 1, 2, 3, ... in order
        metrics = core.train_step(batch)
    core.save_checkpoint("runs/x"); print(core.weights_digest())
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from bus.errors import Rejected
from configs import RunConfig
from configs.paths import CHECKPOINT_PREFIX, RunPaths
from roles.lib.model import lora
from roles.lib.model.loading import compile_blocks, load_model, resolve_device
from roles.lib.model.weights import (
    adapter_tensors,
    adapters_of,
    digest,
    load_state_bytes,
    tensors_to_bytes,
    untied_state,
    verified,
)
from roles.lib.threads import torch_threads
from roles.trainer.loss import PHASES, LossStats, known, loss_denominators, policy_loss
from roles.trainer.packing import MicroBatch, collate_batch
from schemas import BatchAssembled, stable_seed


class StepOutOfOrder(Exception):
    """A batch that is not the next step of this trainer (a gap or a replayed step)."""


class BatchGap(StepOutOfOrder):
    """A batch past the next step: an earlier batch is missing."""


def batch_problem(batch: BatchAssembled) -> str | None:
    """Why ``batch`` cannot be trained at all, or None.

    A pure function of the batch (no config, no model): rank 0, the other ranks, a
    restarted trainer and a replay all refuse exactly the same batches, which is what
    lets a refused batch count as a step without breaking bit-exact replay.
    """
    if batch.phase not in PHASES:
        return f"batch step {batch.step}: unknown phase {batch.phase!r} (expected one of {PHASES})"
    for i, sample in enumerate(batch.samples):
        if (problem := sample.problem()) is not None:
            return f"batch step {batch.step} sample {i} (rollout {sample.rollout_id}): {problem}"
    return None


def take_step(trainer: Any, batch: BatchAssembled) -> tuple[dict[str, float], str | None]:
    """Step ``batch.step`` on ``batch``: (its metrics, why it was refused or None).

    The one definition of a trainer step that the role, its catch-up and trainer replay
    share: the batch is trained, or, refused before anything was trained (``Rejected``:
    ``batch_problem``), it is a step all the same that trains nothing (``refuse_step``).
    ``trainer`` is a ``TrainerCore`` or a multi-rank trainer (``roles.trainer.group``)."""
    try:
        return trainer.train_step(batch), None
    except Rejected as e:
        return trainer.refuse_step(batch), str(e)


def lr_at(cfg: RunConfig, step: int, phase: str = "rl") -> float:
    """Learning rate of batch ``step`` (1-based).

    Linear warmup over ``trainer.warmup_steps`` (step s gets s/warmup of the base), then
    constant, linear or cosine decay over the steps left until ``max_steps``: the first
    step after warmup gets the full base, the last one ``base / remaining`` (linear).
    SFT-phase batches use ``orchestrator.warmup.lr`` as a constant when it is set.
    """
    t = cfg.trainer
    if phase == "sft" and cfg.orchestrator.warmup.lr is not None:
        return cfg.orchestrator.warmup.lr
    if t.warmup_steps and step <= t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    remaining = max(1, cfg.max_steps - t.warmup_steps)
    progress = min(1.0, max(0.0, (step - 1 - t.warmup_steps) / remaining))
    if t.lr_schedule == "linear":
        return t.lr * (1.0 - progress)
    return t.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


# Dense bf16 TFLOP/s by GPU name (what MFU is a share of): the SXM parts' datasheet figures.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def peak_flops(given_tflops: float | None, device: str) -> float | None:
    """The trainer device's peak FLOP/s: ``trainer.peak_tflops`` when set, else the
    GPU's from ``PEAK_TFLOPS`` by name; None (no MFU) on the CPU or an unknown GPU."""
    if given_tflops is not None:
        return given_tflops * 1e12
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((t * 1e12 for gpu, t in PEAK_TFLOPS.items() if gpu in name), None)


class CheckpointMismatch(Exception):
    """A checkpoint written by a trainer of another world size."""


class TrainerCore:
    """Model + AdamW + step counter; ``train_step`` applies one batch.

    One process holds the whole model. ``roles.trainer.sharded.ShardedCore`` is the same
    fold on one rank of many: it overrides the hooks marked "(rank hook)" below.
    """

    world_size = 1

    def __init__(self, cfg: RunConfig, model_dir: str | Path, device: str | None = None):
        self.cfg = cfg
        self.device = resolve_device(device or cfg.trainer.device)
        if self.device.startswith("cuda"):
            # cuBLAS is deterministic only with a fixed workspace; it must be set before
            # cuBLAS initialises, i.e. before the model's first matmul on the GPU.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        # bf16 autocast over fp32 master weights on CUDA ("auto"); exact fp32 on the CPU.
        precision = cfg.trainer.precision
        self.autocast = precision == "bf16" or (
            precision == "auto" and self.device.startswith("cuda")
        )
        model = load_model(
            model_dir,
            dtype=cfg.model.dtype,
            device=self.device,
            local_files_only=cfg.model.local_files_only,
        )
        model.train()
        t = cfg.trainer
        if t.lora is not None:  # only the adapters train (roles.lib.model.lora)
            model = lora.wrap(model, t.lora, stable_seed(cfg.seed, "trainer", "lora"))
        if t.compile:
            compile_blocks(model)
        self._cache_kwarg, self._prefix_kwargs = cache_kwargs(model)
        self.model = self._wrap(model)
        self.pad_id = int(self.model.config.pad_token_id or 0)
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=t.lr,
            betas=(t.betas[0], t.betas[1]),
            weight_decay=t.weight_decay,
        )
        self.step = 0  # batches trained == current policy version
        self.threads = torch_threads()
        self.params = sum(p.numel() for p in self.model.parameters())  # tied: once
        self.peak_flops = peak_flops(cfg.trainer.peak_tflops, self.device)

    # -- rank hooks: one process holds everything ----------------------------------------

    def _wrap(self, model: Any) -> Any:
        """The model the optimizer steps (rank hook: FSDP2 shards it)."""
        return model

    def share(self, n_micro_batches: int, step: int) -> list[int | None]:
        """The micro-batches this process trains, in order (rank hook; None = a pass
        that trains nothing, so every rank runs as many passes)."""
        return list(range(n_micro_batches))

    def shares_prefixes(self) -> bool:
        """Whether a step runs a prefix that samples share once (``trainer.shared_prefix``,
        ``roles.trainer.packing``): where the model's forward takes a KV cache, and not
        with ``trainer.compile``, whose compiled blocks guard on each layer's cache
        state and recompile per layer and pass until torch's recompile limit leaves the
        rest eager (rank hook: sharded ranks train whole rows)."""
        t = self.cfg.trainer
        return t.shared_prefix and not t.compile and self._cache_kwarg is not None

    def _sync_gradients(self, last: bool) -> None:
        """Before each pass (rank hook: ranks reduce gradients in the last pass only)."""

    def _empty_backward(self, logits: torch.Tensor | None) -> None:
        """A pass that trains nothing (rank hook: ranks must backward as often as each
        other, so sharded ranks run a zero-weighted one)."""

    def reduce_stats(self, stats: LossStats) -> LossStats:
        """This step's loss stats over the whole batch (rank hook: a sum over ranks)."""
        return stats

    def close(self, broken: bool = False) -> None:
        """Release what the core holds beyond memory (rank hook: the process group and
        the other ranks, stopped at once when ``broken``)."""

    # -- training -----------------------------------------------------------------------

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if not self.autocast:
            return contextlib.nullcontext()
        return torch.autocast(device_type=torch.device(self.device).type, dtype=torch.bfloat16)

    @contextlib.contextmanager
    def _deterministic(self, step: int) -> Iterator[None]:
        prev_threads = torch.get_num_threads()
        prev_det = torch.are_deterministic_algorithms_enabled()
        prev_warn = torch.is_deterministic_algorithms_warn_only_enabled()
        devices = [torch.device(self.device).index or 0] if self.device.startswith("cuda") else []
        torch.set_num_threads(self.threads)
        # CPU kernels have deterministic versions; on GPU some do not, and warn instead.
        torch.use_deterministic_algorithms(True, warn_only=self.device != "cpu")
        try:
            with torch.random.fork_rng(devices=devices):
                torch.manual_seed(stable_seed(self.cfg.seed, "trainer", step))
                yield
        finally:
            torch.use_deterministic_algorithms(prev_det, warn_only=prev_warn)
            torch.set_num_threads(prev_threads)

    def check_next(self, batch: BatchAssembled) -> None:
        """Raise unless ``batch`` is step ``self.step + 1`` (``BatchGap`` if past it)."""
        if batch.step > self.step + 1:
            raise BatchGap(
                f"batch {batch.event_id} has step {batch.step} but the trainer is at step "
                f"{self.step}: step {self.step + 1} is missing"
            )
        if batch.step != self.step + 1:
            raise StepOutOfOrder(f"batch step {batch.step} is not the next step ({self.step + 1})")

    def reconfigure(self, cfg: RunConfig) -> None:
        """Continue under ``cfg`` (a replay's fork): the fold reads its config every step;
        AdamW's hyper-parameters live in its param groups (the learning rate is set per
        step)."""
        if cfg.trainer.world_size != self.cfg.trainer.world_size:
            raise ValueError(
                f"trainer.world_size cannot change within a run ({self.cfg.trainer.world_size} "
                f"-> {cfg.trainer.world_size}): the sharding of every step would change"
            )
        self.cfg = cfg
        for group in self.optimizer.param_groups:
            group["betas"] = tuple(cfg.trainer.betas)
            group["weight_decay"] = cfg.trainer.weight_decay

    def micro_batches(self, batch: BatchAssembled) -> tuple[list[MicroBatch], dict[str, int]]:
        """``batch`` packed into micro-batches, and the loss denominators over all of them
        (per channel, before the first backward: see trainer.loss). Pure: a malformed
        batch raises here, before anything is trained."""
        cfg = self.cfg.trainer
        share = self.shares_prefixes()
        mbs = collate_batch(batch.samples, cfg.seq_len, cfg.micro_batch_size, self.pad_id, share)
        return mbs, loss_denominators([mb.loss for mb in mbs], batch.phase, cfg.loss.normalize)

    def check_trainable(self, batch: BatchAssembled) -> None:
        """Raise ``Rejected`` (dead-lettered at once, never retried) for a batch that
        ``batch_problem`` refuses; the caller then steps over it with ``refuse_step``."""
        if (problem := batch_problem(batch)) is not None:
            raise Rejected(f"refused: {problem}")

    def train_step(self, batch: BatchAssembled) -> dict[str, float]:
        """Train on ``batch`` (which must be step ``self.step + 1``); returns its metrics.

        A refused batch raises ``Rejected`` before anything is trained (see the module
        docstring; ``refuse_step`` then counts it as a step)."""
        self.check_next(batch)
        self.check_trainable(batch)
        start = time.perf_counter()
        return self.train_packed(batch, *self.micro_batches(batch), start=start)

    def refuse_step(self, batch: BatchAssembled) -> dict[str, float]:
        """Count the refused ``batch`` as step ``batch.step`` that trained nothing.

        Weights, optimizer state and RNG are untouched: the version this step announces
        is the previous weights, and the next batch follows it. Without this a refused
        batch would leave a hole in the steps that every later batch waits behind
        (``BatchGap``), and the orchestrator, which waits for the trainer's versions,
        would wait for ever. A batch that can be trained is never stepped over.
        """
        self.check_next(batch)
        if batch_problem(batch) is None:
            raise ValueError(f"batch step {batch.step} is trainable: it must not be refused")
        self.step = batch.step
        return {
            "refused_batch": 1.0,
            "samples": float(len(batch.samples)),
            "tokens": float(sum(len(s) for s in batch.samples)),
            "world_size": float(self.world_size),
        }

    def train_packed(
        self,
        batch: BatchAssembled,
        mbs: list[MicroBatch],
        denominators: dict[str, int],
        start: float,
    ) -> dict[str, float]:
        """``train_step`` once ``batch`` is packed (``micro_batches``) and checked; ``start``
        is when the step began, for ``tokens_per_s``."""
        cfg = self.cfg.trainer
        lr = lr_at(self.cfg, batch.step, batch.phase)
        samples = batch.samples
        stats = LossStats()
        with self._deterministic(batch.step):
            self.optimizer.zero_grad(set_to_none=True)
            mine = self.share(len(mbs), batch.step)
            # Every micro-batch this process trains goes to the device before the first
            # forward: a copy from host memory waits for the device's queue to drain,
            # which here it already has (on the CPU, ``to`` is a no-op).
            moved = {i: mbs[i].to(self.device) for i in mine if i is not None}
            for n, i in enumerate(mine):
                self._sync_gradients(last=n == len(mine) - 1)
                if i is None or mbs[i].input_ids.shape[1] < 2:  # one-token samples predict nothing
                    self._empty_backward(None)
                    continue
                mb, on_device = mbs[i], moved[i]
                with self._autocast():
                    logits = self._forward(on_device)
                # Per-token logprobs in fp32 whatever the forward ran in (a no-op in fp32);
                # what the loss must know on the host is read from the host copy.
                facts = known(mb.loss, batch.phase)
                loss, s = policy_loss(
                    logits[:, :-1].float(),
                    on_device.loss,
                    cfg.loss,
                    batch.phase,
                    denominators,
                    facts,
                )
                if facts.loss_tokens:
                    loss.backward()
                else:
                    self._empty_backward(logits)
                stats = stats + s
            stats = self.reduce_stats(stats.on_host())  # the step's one wait for its stats
            params = [p for p in self.model.parameters() if p.grad is not None]
            grad_norm = (
                _norm(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)) if params else 0.0
            )
            # Both numbers are over the whole batch (summed over ranks; the norm of
            # sharded gradients is global), so every rank takes the same decision.
            finite = math.isfinite(stats.loss) and math.isfinite(grad_norm)
            if finite:
                for group in self.optimizer.param_groups:
                    group["lr"] = lr
                self.optimizer.step()
            # A non-finite step is dropped whole: no optimizer step, its gradients gone.
            self.optimizer.zero_grad(set_to_none=True)
        self.step = batch.step
        elapsed = time.perf_counter() - start
        tokens = sum(len(s) for s in samples)
        computed = sum(mb.num_tokens for mb in mbs)
        return {
            **stats.finalize(),
            **({} if finite else {"nonfinite_step": 1.0}),
            "grad_norm": grad_norm,
            "lr": lr,
            "tokens": float(tokens),
            "computed_tokens": float(computed),  # a shared prefix once (trainer.shared_prefix)
            "samples": float(len(samples)),
            "micro_batches": float(len(mbs)),
            "world_size": float(self.world_size),  # replay trains on as many ranks
            "threads": float(self.threads),  # ... with as many intra-op threads each
            "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0,
            "step_s": elapsed,
            **self._utilisation(computed, elapsed),
        }

    def _forward(self, mb: MicroBatch) -> torch.Tensor:
        """The logits over ``mb``'s rows, ``[B, L, V]`` (``mb`` on the device).

        A shared micro-batch (``mb.prefix``) runs in two forwards: its prefixes, once
        each, for their keys and values alone (the logits of their last token only: none
        is trained), then its rows, which read those keys and values as a KV cache. Each
        row's copy of its prefix's is an ``index_select`` (the cache's ``reorder_cache``,
        beam search's), whose backward sums every row's gradient into the prefix's: the
        prefix trains exactly as it would within every row.
        """
        if mb.prefix is None:
            return self.model(input_ids=mb.input_ids, use_cache=False).logits
        pre, name = mb.prefix, self._cache_kwarg
        assert name is not None  # shares_prefixes() packed it
        out = self.model(
            input_ids=pre.input_ids,
            attention_mask=pre.attention_mask,
            position_ids=pre.position_ids,
            use_cache=True,
            **self._prefix_kwargs,
        )
        cache = getattr(out, name)
        cache.reorder_cache(pre.rows)
        return self.model(
            input_ids=mb.input_ids,
            attention_mask=pre.row_attention_mask,
            position_ids=pre.row_position_ids,
            use_cache=True,
            **{name: cache},
        ).logits

    def _utilisation(self, tokens: int, elapsed: float) -> dict[str, float]:
        """Model FLOPs per second (6 x parameters x tokens: forward and backward; the
        tokens the model ran, a shared prefix once) and, where the device's peak is
        known, MFU (``peak_flops``); timing, never replayed."""
        if elapsed <= 0:
            return {}
        flops = 6.0 * self.params * tokens / elapsed
        return {
            "flops_per_s": flops,
            **({"mfu": flops / self.peak_flops} if self.peak_flops else {}),
        }

    # -- weights ------------------------------------------------------------------------

    def weights_bytes(self) -> bytes:
        """The current weights as safetensors bytes (what ``weights.published`` names):
        the whole model, or with ``trainer.lora`` its adapters."""
        return tensors_to_bytes(self.weights_tensors())

    def weights_tensors(self) -> dict[str, torch.Tensor]:
        """The named tensors ``weights_bytes`` writes (the model's, no copies)."""
        lo = self.cfg.trainer.lora
        if lo is not None:
            return adapter_tensors(lora.adapter_state(self.model), lora.scale(lo.alpha, lo.rank))
        return untied_state(self.model)

    def weights_snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of ``weights_tensors`` where they are (on a GPU, device to device: a
        fraction of a millisecond), for ``tensors_to_bytes`` to write while the next step
        trains: the same bytes ``weights_bytes`` gives now."""
        return {name: t.detach().clone() for name, t in self.weights_tensors().items()}

    def weights_digest(self) -> str:
        return digest(self.weights_bytes())

    # -- checkpoints --------------------------------------------------------------------

    def save_checkpoint(self, run_dir: str | Path, extra: dict[str, Any] | None = None) -> Path:
        """Snapshot under ``<run_dir>/checkpoints/step-N`` (atomic), then delete those
        ``checkpoints_to_delete`` names (never the one just written)."""
        paths = RunPaths.at(run_dir)
        root = paths.checkpoints
        root.mkdir(parents=True, exist_ok=True)
        final = paths.checkpoint(self.step)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{final.name}-", dir=root))
        try:
            state = {
                "step": self.step, "world_size": self.world_size, "extra": extra or {},
                **self.write_snapshot(tmp),
            }  # fmt: skip
            (tmp / "state.json").write_text(json.dumps(state, sort_keys=True))
            for f in filter(Path.is_file, tmp.iterdir()):
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            if final.exists():  # the same step saved again (e.g. interval, then stop)
                old = root / f".old-{final.name}-{os.getpid()}"
                final.rename(old)
                shutil.rmtree(old)
            tmp.rename(final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
        found = {_step_of(p): p for p in _checkpoints(root)}
        t = self.cfg.trainer
        for step in checkpoints_to_delete(list(found), t.keep_checkpoints, t.checkpoint_keep_every):
            shutil.rmtree(found[step], ignore_errors=True)
        return final

    def write_snapshot(self, folder: Path) -> dict[str, Any]:
        """Write model and optimizer into ``folder``; returns what state.json adds (rank
        hook: ranks write their shards with torch.distributed.checkpoint)."""
        weights = self.weights_bytes()
        (folder / "model.safetensors").write_bytes(weights)
        torch.save(self.optimizer.state_dict(), folder / "optimizer.pt")
        return {"weights_digest": digest(weights)}

    def read_snapshot(self, folder: Path, state: dict[str, Any]) -> None:
        """Inverse of ``write_snapshot`` (rank hook)."""
        data = (folder / "model.safetensors").read_bytes()
        if self.cfg.trainer.lora is not None:
            adapter = adapters_of(verified(data, state["weights_digest"]))
            if adapter is None:
                raise ValueError(f"{folder}: a whole model's weights, but trainer.lora is set")
            lora.load_adapter_state(self.model, adapter[0])
        else:
            load_state_bytes(self.model, data, state["weights_digest"])
        opt = torch.load(folder / "optimizer.pt", map_location=self.device, weights_only=True)
        self.optimizer.load_state_dict(opt)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        """Restore model, optimizer and step from ``path``; returns the saved ``extra``."""
        path = Path(path)
        state = json.loads((path / "state.json").read_text())
        saved = int(state.get("world_size", 1))
        if saved != self.world_size:
            raise CheckpointMismatch(
                f"checkpoint {path} was written by {saved} trainer rank(s) but "
                f"trainer.world_size is {self.world_size}: resume with "
                f"trainer.world_size={saved}"
            )
        self.read_snapshot(path, state)
        self.step = int(state["step"])
        extra: dict[str, Any] = state.get("extra", {})
        return extra


def cache_kwargs(model: Any) -> tuple[str | None, dict[str, int]]:
    """The name ``model``'s forward takes a KV cache by, or None where it takes none (its
    samples train as whole rows); and the arguments that keep a prefix forward's logits
    to its last token, where the forward has them (a wide vocabulary's logits over every
    prefix token would cost memory and time for nothing). A peft model passes these on
    to its base model.

    Only transformers 5's ``cache``, whose forward always returns the cache object it
    filled; the ``past_key_values`` of older versions comes back from some (4.44-4.46)
    as a tuple of tensors, which has no ``reorder_cache``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters
    name = "cache" if "cache" in params else None
    return name, {"logits_to_keep": 1} if "logits_to_keep" in params else {}


def _norm(total: torch.Tensor) -> float:
    """A norm as a float; a sharded model's is a DTensor whose full value is the norm."""
    full = getattr(total, "full_tensor", None)
    return float(full() if full is not None else total)


def checkpoints_to_delete(steps: list[int], keep: int, keep_every: int) -> list[int]:
    """The checkpoint steps to delete, oldest first: all but the newest ``keep`` (0: none
    is deleted) and those that are a multiple of ``keep_every`` (0: no such rule).

    Pure, so the rule is tested alone; the newest checkpoint, which a restart resumes
    from, is never among them.
    """
    if keep == 0:
        return []
    ordered = sorted(steps)
    return [s for s in ordered[:-keep] if not (keep_every and s % keep_every == 0)]


def _step_of(path: Path) -> int:
    return int(path.name.removeprefix(CHECKPOINT_PREFIX))


def _checkpoints(root: Path) -> list[Path]:
    """Finished checkpoints under ``root``, oldest first."""
    found = []
    for p in root.glob(f"{CHECKPOINT_PREFIX}*"):
        suffix = p.name.removeprefix(CHECKPOINT_PREFIX)
        if p.is_dir() and suffix.isdigit() and (p / "state.json").exists():
            found.append((int(suffix), p))
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest finished checkpoint under ``<run_dir>/checkpoints``, or None."""
    found = _checkpoints(RunPaths.at(run_dir).checkpoints)
    return found[-1] if found else None
