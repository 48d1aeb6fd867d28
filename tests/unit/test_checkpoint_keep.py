"""Which trainer checkpoints stay (``trainer.keep_checkpoints``, ``trainer.checkpoint_keep_every``)
and what ``rlbus eval --checkpoint RUN:STEP`` says of a step that is gone (no server, no model)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import typer

from configs import ConfigError, dump_toml, load_config
from configs.paths import RunPaths
from roles.cli.eval import missing_step, run_checkpoint
from roles.trainer.core import TrainerCore, checkpoints_to_delete


@pytest.mark.parametrize(
    ("steps", "keep", "every", "deleted"),
    [
        ([10, 20, 30, 40], 2, 0, [10, 20]),  # the newest two, as before the keys existed
        ([10, 20, 30, 40], 1, 20, [10, 30]),  # 20 and 40 by the stride, 40 also the newest
        ([100, 110, 120, 490, 500], 2, 100, [110, 120]),  # a default run's tail
        ([3, 6, 9], 0, 0, []),  # 0 keeps every checkpoint
        ([40, 10, 30, 20], 2, 0, [10, 20]),  # the order they are listed in does not matter
        ([5], 1, 4, []),  # the newest is never deleted, multiple or not
        ([15, 25, 35], 1, 10, [15, 25]),  # no step is a multiple of the stride: newest only
    ],
)
def test_checkpoints_to_delete_keeps_the_newest_and_the_stride(
    steps: list[int], keep: int, every: int, deleted: list[int]
) -> None:
    """The newest ``keep`` and every multiple of ``every`` stay; the rest go, oldest first."""
    assert checkpoints_to_delete(steps, keep, every) == deleted


class _FakeCore(TrainerCore):
    """A core without a model: only what ``save_checkpoint`` touches."""

    def __init__(self, *overrides: str) -> None:  # no super().__init__: nothing to load
        self.cfg = load_config("smoke", list(overrides))
        self.step = 0

    def write_snapshot(self, folder: Path) -> dict[str, Any]:
        (folder / "model.safetensors").write_bytes(b"w")
        return {"weights_digest": f"d{self.step}"}


def _on_disk(run_dir: Path) -> list[int]:
    paths = RunPaths.at(run_dir)
    return sorted(
        json.loads((p / "state.json").read_text())["step"] for p in paths.checkpoints.iterdir()
    )


def test_save_checkpoint_prunes_by_the_run_config(tmp_path: Path) -> None:
    """The trainer's save applies the config's keys: here the newest 2, and every 4th step."""
    core = _FakeCore("trainer.keep_checkpoints=2", "trainer.checkpoint_keep_every=4")
    for step in range(1, 11):
        core.step = step
        core.save_checkpoint(tmp_path)
    assert _on_disk(tmp_path) == [4, 8, 9, 10]
    # No half-written or renamed leftovers beside them.
    assert sorted(p.name for p in RunPaths.at(tmp_path).checkpoints.iterdir()) == [
        "step-00000004", "step-00000008", "step-00000009", "step-00000010",
    ]  # fmt: skip


def test_save_checkpoint_with_zero_keeps_every_checkpoint(tmp_path: Path) -> None:
    core = _FakeCore("trainer.keep_checkpoints=0", "trainer.checkpoint_keep_every=0")
    for step in (3, 6, 9):
        core.step = step
        core.save_checkpoint(tmp_path)
    assert _on_disk(tmp_path) == [3, 6, 9]


@pytest.mark.parametrize("key", ["trainer.keep_checkpoints", "trainer.checkpoint_keep_every"])
def test_negative_keep_keys_are_refused_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("smoke", [f"{key}=-1"])


def test_the_defaults_keep_a_default_runs_hundreds() -> None:
    """A default run (500 steps, a checkpoint every 10) keeps 100..500 and 490: what the
    docs' ``rlbus eval --checkpoint <run>:200`` needs."""
    t = load_config("default").trainer
    written = list(range(t.checkpoint_interval, 501, t.checkpoint_interval))
    deleted = set(checkpoints_to_delete(written, t.keep_checkpoints, t.checkpoint_keep_every))
    assert sorted(set(written) - deleted) == [100, 200, 300, 400, 490, 500]


def _run_with_checkpoints(data: Path, run: str, steps: list[int], *overrides: str) -> RunPaths:
    paths = RunPaths(data, run)
    paths.dir.mkdir(parents=True)
    paths.config.write_text(dump_toml(load_config("smoke", list(overrides))))
    for step in steps:
        folder = paths.checkpoint(step)
        folder.mkdir(parents=True)
        (folder / "state.json").write_text(json.dumps({"step": step}))
        (folder / "model.safetensors").write_bytes(b"w")
    return paths


def test_a_missing_step_lists_what_is_kept_and_the_keys_with_the_runs_values(
    tmp_path: Path,
) -> None:
    paths = _run_with_checkpoints(
        tmp_path, "r", [100, 490, 500], "trainer.checkpoint_keep_every=100",
        "trainer.keep_checkpoints=2", "trainer.checkpoint_interval=10",
    )  # fmt: skip
    said = missing_step(120, [100, 490, 500], paths.config)
    assert said.startswith("no step 120 (kept: 100, 490, 500)")
    for named in ("trainer.keep_checkpoints (2)", "trainer.checkpoint_keep_every (100)",
                  "trainer.checkpoint_interval (10)"):  # fmt: skip
        assert named in said
    # A run whose config is gone still gets the keys, without values.
    assert "trainer.keep_checkpoints and" in missing_step(1, [2], tmp_path / "none.toml")


def test_eval_of_a_missing_step_fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _run_with_checkpoints(tmp_path, "r", [4, 5, 6], "trainer.checkpoint_keep_every=2")
    assert run_checkpoint(tmp_path, "r:4") == RunPaths(tmp_path, "r").checkpoint(4)
    with pytest.raises(typer.Exit) as exit_:
        run_checkpoint(tmp_path, "r:3")
    assert exit_.value.exit_code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1
    assert "no step 3 (kept: 4, 5, 6)" in lines[0]
    assert "trainer.checkpoint_keep_every (2)" in lines[0]
