"""The trainer's fold on one rank of many: FSDP2 shards parameters, gradients and
AdamW state across ``trainer.world_size`` processes joined by ``torch.distributed``.

Every rank holds the whole batch and packs it exactly as one process would
(``roles.trainer.packing``); rank ``r`` then trains the micro-batches ``i`` with
``(i + step) % world_size == r`` (``share``), a pure function of step, world size and
rank, so a run and its replay on as many ranks train the same tokens in the same order.
The loss of each micro-batch is already normalised over the whole batch
(``loss_denominators``), so the batch gradient is the *sum* of the ranks' gradients:
FSDP2's reduce-scatter sums (divide factor 1) instead of averaging. FSDP runs a
collective in every forward and backward, so each rank runs as many passes: a rank
short of a micro-batch (or holding one that trains no token) runs a zero-weighted pass,
which adds exact zeros. Loss stats are summed over ranks before they are reported;
the gradient norm of the DTensor parameters is already global. So the decision to drop
a non-finite step (``TrainerCore``) is taken on the same numbers on every rank, and
every rank skips the same optimizer step.

A refused batch (``core.batch_problem``) is refused by rank 0 before any rank trains
it; rank 0 then sends it on so that the other ranks step over it too (their
``train_step`` meets the same problem and calls ``refuse_step``: no collective runs), and
every rank's fold stays at the same step.

Gloo on CPU sums in a fixed order for a fixed world size, so a 2-rank run is bit for bit
reproducible by a 2-rank replay (but differs from a 1-rank run in the last bits: the
sums run in another order; ``tests/integration/test_trainer_ranks.py`` bounds it).

Weights are gathered in full to rank 0 for publishing (the same safetensors bytes a
single process writes, tied copies dropped); checkpoints are sharded
(``torch.distributed.checkpoint``: one file per rank plus metadata, in the checkpoint
folder ``TrainerCore.save_checkpoint`` makes atomic) and resume on as many ranks.

    core = ShardedCore(cfg, model_dir, rank=r, world_size=2, master="127.0.0.1:29500")

is what each rank runs; ``roles.trainer.group`` starts the ranks and drives them.
FSDP and distributed checkpointing are imported where they are used (a second of
imports, sympy among them, that a one-process trainer, which never makes a
``ShardedCore``, does not pay at start).
"""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from configs import RunConfig
from roles.lib.model.loading import transformer_blocks
from roles.lib.model.weights import digest, tensors_to_bytes, tied_keys
from roles.trainer.core import TrainerCore, batch_problem
from roles.trainer.loss import LossStats
from schemas import BatchAssembled

_STAT_FIELDS = tuple(LossStats.__dataclass_fields__)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: on CUDA its own GPU, counted from the configured one
    (``cuda:1`` puts rank 0 on GPU 1, rank 1 on GPU 2), else the CPU."""
    if not device.startswith("cuda"):
        return device
    return f"cuda:{(torch.device(device).index or 0) + rank}"


class ShardedCore(TrainerCore):
    """``TrainerCore`` on rank ``rank`` of ``world_size`` (see the module docstring)."""

    def __init__(
        self,
        cfg: RunConfig,
        model_dir: str | Path,
        *,
        rank: int,
        world_size: int,
        master: str,
        device: str,
    ):
        self.rank, self.world_size = rank, world_size
        device = rank_device(device, rank)
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(
            backend,
            init_method=f"tcp://{master}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=cfg.trainer.collective_timeout_s),
        )
        self._tied: set[str] = set()
        super().__init__(cfg, model_dir, device=device)

    def _wrap(self, model: Any) -> Any:
        from torch.distributed.fsdp import fully_shard

        # Names of tied copies (lm_head = embed_tokens) are only visible before sharding:
        # the gathered state dict holds such a copy as a tensor of its own.
        self._tied = set(tied_keys(model.state_dict()))
        # One FSDP unit per transformer block, the rest (embeddings, final norm, head)
        # in the root's.
        units = [*transformer_blocks(model), model]
        for unit in units:
            fully_shard(unit, reshard_after_forward=False)
        for unit in units:  # per unit: the root's setting does not reach the blocks
            # Sum the ranks' gradients (see above) with a plain SUM (gloo has no PREMUL_SUM).
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        return model

    def train_step(self, batch: BatchAssembled) -> dict[str, float]:
        """On ranks 1..N-1: a batch rank 0 refused is stepped over here too (rank 0 never
        sends one it did not refuse first: see ``GroupLeader.refuse_step``)."""
        if self.rank and batch_problem(batch) is not None:
            return self.refuse_step(batch)
        return super().train_step(batch)

    def shares_prefixes(self) -> bool:
        # Whole rows on sharded ranks: a shared micro-batch runs the FSDP units twice
        # (prefixes, then rows) before one backward, which the ranks' gradient
        # reduction has not been verified with (tests/integration/test_trainer_ranks.py).
        return False

    def share(self, n_micro_batches: int, step: int) -> list[int | None]:
        ws, r = self.world_size, self.rank
        mine: list[int | None] = [i for i in range(n_micro_batches) if (i + step) % ws == r]
        passes = -(-n_micro_batches // ws)
        return mine + [None] * (passes - len(mine))

    def _sync_gradients(self, last: bool) -> None:
        # Accumulate unsharded gradients over a rank's passes and reduce-scatter once, in
        # the last: one collective per step instead of one per micro-batch.
        self.model.set_requires_gradient_sync(last)
        self.model.set_reshard_after_backward(last)

    def _empty_backward(self, logits: torch.Tensor | None) -> None:
        if logits is None:  # a pass with no micro-batch: forward two pad tokens
            ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.device)
            with self._autocast():
                logits = self.model(input_ids=ids, use_cache=False).logits
        assert logits is not None
        (logits.float().sum() * 0.0).backward()

    def reduce_stats(self, stats: LossStats) -> LossStats:
        values = torch.tensor(
            [float(getattr(stats, f)) for f in _STAT_FIELDS],
            dtype=torch.float64,
            device=self.device,
        )
        dist.all_reduce(values)
        summed = dict(zip(_STAT_FIELDS, values.tolist(), strict=True))
        maxed = [f for f in _STAT_FIELDS if f in LossStats.MAXED]
        peaks = torch.tensor([float(getattr(stats, f)) for f in maxed], dtype=torch.float64,
                             device=self.device)  # fmt: skip
        dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
        summed.update(zip(maxed, peaks.tolist(), strict=True))
        ints = {f for f in _STAT_FIELDS if isinstance(getattr(stats, f), int)}
        return LossStats(**{f: int(v) if f in ints else v for f, v in summed.items()})

    def weights_bytes(self) -> bytes:
        """The full weights, gathered: safetensors bytes on rank 0, b"" on the others
        (every rank must call it: the gather is a collective)."""
        return self._gather_weights()

    def _gather_weights(self) -> bytes:
        # Not overridden by rank 0's GroupLeader (which sends each public call to the
        # other ranks first): write_snapshot gathers inside a call they already run.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if self.rank != 0:
            return b""
        tensors = {k: v for k, v in full.items() if k not in self._tied}
        return tensors_to_bytes(tensors)  # type: ignore[arg-type]  # full: plain tensors

    def write_snapshot(self, folder: Path) -> dict[str, Any]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
        # The full weights too, as one process writes them: `rlbus model export` and
        # whoever reads a checkpoint's model need no torch.distributed (rank 0 writes).
        weights = self._gather_weights()
        if self.rank != 0:
            return {}
        (folder / "model.safetensors").write_bytes(weights)
        return {"weights_digest": digest(weights)}

    def read_snapshot(self, folder: Path, state: dict[str, Any]) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=str(folder))
        # dcp.load fills the dicts in place
        set_state_dict(
            self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state
        )

    def close(self, broken: bool = False) -> None:
        """Leave the process group (a process holds one at a time; idempotent)."""
        if dist.is_initialized():
            dist.destroy_process_group()
