"""A LoRA run end to end (issue 34): a 3-step smoke run (`rlbus up`, real role processes)
with `trainer.lora`, inference serving each adapter version merged into its base, then
what a user does with the run: replay the trainer bit for bit, export the policy as a
merged model, and load that. About 20 s here (2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from roles.lib.model.loading import load_model
from roles.lib.model.weights import adapter_scale
from schemas import WeightsPublished
from tests.e2e.helpers import finished_run, rlbus

RUN = "lora1"
LORA = 'trainer.lora={rank=4, alpha=8, modules_to_save=["embed_tokens"]}'


@pytest.mark.e2e
async def test_a_lora_run_serves_adapters_and_replays_bit_for_bit(tmp_path: Path) -> None:
    """Every version the trainer publishes is an adapter blob (a fraction of the model);
    inference swaps each in (its log says so); `rlbus replay trainer` reproduces every
    step's digest; `rlbus model export` writes the merged policy, whose weights differ
    from the base's exactly in the adapted layers and the embeddings."""
    events = await finished_run(tmp_path, RUN, LORA, steps=3)
    published = [e for e in events if isinstance(e, WeightsPublished) and e.version > 0]
    assert [e.version for e in published] == [1, 2, 3]
    blobs = [Path(e.weights.location) for e in published if e.weights.kind == "path"]
    assert not blobs  # small enough for the object store
    base_bytes = sum(f.stat().st_size for f in (tmp_path / RUN / "model").rglob("*.safetensors"))
    assert all(e.weights.size * 4 < base_bytes for e in published)
    swapped = [
        json.loads(line)
        for line in (tmp_path / RUN / "logs" / "inference-policy-0.log").read_text().splitlines()
        if '"weights.swapped"' in line
    ]
    assert {s["version"] for s in swapped} >= {3}

    replay = rlbus(tmp_path, "replay", RUN, "trainer")
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert "REPRODUCED 3 steps" in replay.stdout

    export = rlbus(tmp_path, "model", "export", "--run", RUN, "--out", str(tmp_path / "exp"))
    assert export.returncode == 0, export.stdout + export.stderr
    merged = load_model(tmp_path / "exp", dtype="float32", device="cpu").state_dict()
    base = load_model(tmp_path / RUN / "model" / "initial", dtype="float32", device="cpu")
    changed = {k for k, v in base.state_dict().items() if not torch.equal(v, merged[k])}
    assert changed and all(k.endswith(("_proj.weight", "embed_tokens.weight", "lm_head.weight"))
                           for k in changed)  # fmt: skip
    checkpoint = sorted((tmp_path / RUN / "checkpoints").iterdir())[-1]
    assert adapter_scale((checkpoint / "model.safetensors").read_bytes()) == 2.0
