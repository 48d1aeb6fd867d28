"""Weights shared on one device (``trainer.weights_via = "ipc"``): the device digest, the
trainer's ring read by another process, and what a reader refuses. On the CPU the ring
is a shared /dev/shm-style file; the CUDA IPC path is the same code with another handle
(``tests/gpu``)."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from roles.lib.model.shared_weights import (
    PAD,
    ROW,
    Layout,
    SharedReader,
    WeightsRing,
    device_digest,
)
from roles.lib.model.weights import WeightsDigestMismatch, bytes_to_state_dict, tensors_to_bytes
from schemas import ObjectRef

CPU = torch.device("cpu")


def model(seed: int, hidden: int = 64) -> LlamaForCausalLM:
    cfg = LlamaConfig(vocab_size=300, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)


def test_the_device_digest_tells_any_change_of_bytes_or_order_apart() -> None:
    x = torch.randn(8 * PAD, generator=torch.Generator().manual_seed(0))
    d = device_digest(x)
    assert d == device_digest(x.clone()) and d.startswith("dev:float32:") and len(d) == 28
    flipped = x.clone()
    flipped.view(torch.int32)[12345] ^= 1  # one bit
    rows = x.clone().view(-1, ROW)
    rows[[0, 1]] = rows[[1, 0]]  # two rows of words swapped
    words = x.clone().view(-1, ROW)
    words[0, [0, 1]] = words[0, [1, 0]]  # two words of a row swapped
    digests = {d, device_digest(flipped), device_digest(rows), device_digest(words)}
    assert len(digests) == 4
    assert device_digest(x.to(torch.bfloat16)) != device_digest(x[: 4 * PAD])


def _read_in_child(ref: ObjectRef, hidden: int, out: mp.Queue) -> None:
    """Another process: map the ring, copy the slot, load it into a fresh model."""
    target = model(seed=99, hidden=hidden)
    reader = SharedReader(Layout.of(target.state_dict()), CPU)
    reader.load_into(target, reader.read(ref))
    out.put(tensors_to_bytes({k: v.clone() for k, v in target.state_dict().items()}))


def test_another_process_copies_the_announced_version_out_of_the_ring(tmp_path: Path) -> None:
    """What a replica loads from the ring is the trainer's weights, cast to the ring's
    dtype, tied weights tied; a later version in another slot does not disturb it."""
    trainer = model(seed=1)
    ring = WeightsRing.create(Layout.of(trainer.state_dict()), torch.bfloat16, CPU, tmp_path)
    ref = ring.write(4, trainer.state_dict())
    ring.write(5, model(seed=2).state_dict())  # the next slot
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_read_in_child, args=(ref, 64, out))
    child.start()
    got = bytes_to_state_dict(out.get(timeout=60))
    child.join(30)
    assert child.exitcode == 0
    for name, t in trainer.state_dict().items():
        assert torch.equal(got[name], t.to(torch.bfloat16).float()), name  # (the model's fp32)
    assert torch.equal(got["lm_head.weight"], got["model.embed_tokens.weight"])
    ring.close()
    assert ring.path is not None and not ring.path.exists()


def test_a_reader_refuses_an_overwritten_slot_another_model_or_a_gone_ring(tmp_path: Path) -> None:
    trainer = model(seed=1)
    ring = WeightsRing.create(Layout.of(trainer.state_dict()), torch.float32, CPU, tmp_path)
    ref = ring.write(3, trainer.state_dict())
    reader = SharedReader(Layout.of(model(seed=5).state_dict()), CPU)
    assert torch.equal(reader.read(ref)[:10], ring.slot(0)[:10])
    ring.write(3 + ring.slots, model(seed=2).state_dict())  # the trainer ran a lap ahead
    with pytest.raises(WeightsDigestMismatch):
        reader.read(ref)
    wider = SharedReader(Layout.of(model(seed=5, hidden=128).state_dict()), CPU)
    with pytest.raises(ValueError, match="another model"):
        wider.read(ref)
    ring.close()
    with pytest.raises(FileNotFoundError, match="gone"):
        SharedReader(Layout.of(trainer.state_dict()), CPU).read(ref)
