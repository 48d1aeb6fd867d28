"""The trainer on 2 ranks (real processes, gloo, FSDP2) against the 1-rank fold."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from bus.errors import Rejected
from configs import RunConfig, load_config
from roles.lib.model.loading import load_model
from roles.lib.model.tiny import build_tiny_model
from roles.lib.model.weights import digest, load_state_bytes
from roles.trainer.core import CheckpointMismatch, TrainerCore
from roles.trainer.group import GroupBroken, make_trainer, start_ranks
from schemas.arrays import pack_f32
from tests.unit.test_trainer_core import synthetic_batch

# A step's loss on 2 ranks differs from 1 rank's only by float summation order.
LOSS_RTOL = 1e-5


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ranks") / "tiny", seed=0)


def config(world_size: int) -> RunConfig:
    # micro_batch_size=2: 9 samples make 5 micro-batches, so one rank trains 3 and the
    # other 2 plus an empty pass (the uneven case).
    return load_config(
        "smoke",
        ["trainer.seq_len=256", "trainer.lr=1e-3", "trainer.device=cpu",
         "trainer.micro_batch_size=2", f"trainer.world_size={world_size}"],
    )  # fmt: skip


@pytest.fixture
def two_ranks(tiny_dir: Path) -> Iterator[TrainerCore]:
    cfg = config(2)
    core = make_trainer(cfg, tiny_dir, start_ranks(cfg, tiny_dir))
    yield core
    core.close()


BATCHES = [synthetic_batch("ranks", s, n_samples=9) for s in range(1, 7)]


def test_two_ranks_match_one_rank_step_by_step(tiny_dir: Path, two_ranks: TrainerCore) -> None:
    one = TrainerCore(config(1), tiny_dir)
    for batch in BATCHES[:4]:
        a, b = one.train_step(batch), two_ranks.train_step(batch)
        assert b["loss"] == pytest.approx(a["loss"], rel=LOSS_RTOL, abs=1e-7), batch.step
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=LOSS_RTOL)
        # Token counts are summed over ranks exactly: every micro-batch trained once.
        assert b["loss_tokens"] == a["loss_tokens"] and b["micro_batches"] == 5
        assert (a["world_size"], b["world_size"]) == (1.0, 2.0)
    # The gathered weights are a whole model again: they load strictly into one process.
    data = two_ranks.weights_bytes()
    model = load_model(tiny_dir)
    load_state_bytes(model, data, digest(data))


def test_a_sharded_checkpoint_resumes_bit_for_bit(
    tiny_dir: Path, two_ranks: TrainerCore, tmp_path: Path
) -> None:
    """Steps 1-4, checkpoint, a new group loads it and trains 5-6: the same digests as a
    group that never stopped (optimizer state, step and shards all restored)."""
    for batch in BATCHES[:4]:
        two_ranks.train_step(batch)
    path = two_ranks.save_checkpoint(tmp_path, {"batch_seq": 4})
    assert sorted(p.name for p in path.iterdir()) == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "model.safetensors", "state.json",
    ]  # fmt: skip  # the full weights too: `rlbus model export` reads them
    straight = []
    for batch in BATCHES[4:]:
        two_ranks.train_step(batch)
        straight.append(two_ranks.weights_digest())
    two_ranks.close()  # a process holds one process group at a time

    cfg = config(2)
    resumed = make_trainer(cfg, tiny_dir, start_ranks(cfg, tiny_dir))
    try:
        assert resumed.load_checkpoint(path) == {"batch_seq": 4} and resumed.step == 4
        again = []
        for batch in BATCHES[4:]:
            resumed.train_step(batch)
            again.append(resumed.weights_digest())
    finally:
        resumed.close()
    assert again == straight

    with pytest.raises(CheckpointMismatch, match="trainer.world_size=2"):
        TrainerCore(config(1), tiny_dir).load_checkpoint(path)


def test_a_dead_rank_breaks_the_group_at_once(two_ranks: TrainerCore) -> None:
    """No collective waits for a rank that is gone: the next call fails with the exit."""
    two_ranks.train_step(BATCHES[0])
    (rank1,) = two_ranks.ranks.procs  # type: ignore[attr-defined]
    rank1.kill()
    rank1.wait()
    with pytest.raises(GroupBroken, match="rank 1 exited with code -9"):
        two_ranks.train_step(BATCHES[1])


def test_a_malformed_batch_fails_alone_and_the_group_trains_on(two_ranks: TrainerCore) -> None:
    """A batch every rank would reject is rejected on rank 0 before any rank sees it: an
    refusal (Rejected: dead-lettered at once, as on one rank), not a broken group."""
    good = BATCHES[0]
    bad_sample = msgspec.structs.replace(good.samples[0], logprobs=pack_f32([0.0]))
    bad = msgspec.structs.replace(good, samples=[bad_sample, *good.samples[1:]])
    with pytest.raises(Rejected, match="sample 0 .*logprobs has 1 values for"):
        two_ranks.train_step(bad)
    assert two_ranks.train_step(good)["loss_tokens"] > 0 and two_ranks.step == 1
