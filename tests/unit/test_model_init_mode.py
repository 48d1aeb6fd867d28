"""A model rlbus writes has the file modes the umask gives, its weights included.

safetensors (0.8) writes through a temporary file created 0600, so `rlbus model init`
left `model.safetensors` readable by its owner only (issue 31); a run's own initial
model was built in a `mkdtemp` folder, 0700. `roles.lib.model.tiny.save_pretrained` and
`ensure_tiny_model` give them the mode of their siblings.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from roles.cli import app


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    """This process's umask, set for the test and restored after it."""
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def modes(folder: Path) -> dict[str, int]:
    return {f.name: f.stat().st_mode & 0o777 for f in folder.iterdir()}


@pytest.mark.parametrize("arch", ["tiny", "qwen3"])
def test_model_init_writes_every_file_with_the_umasks_mode(
    arch: str, umask: int, tmp_path: Path
) -> None:
    out = tmp_path / "model"
    result = CliRunner().invoke(app, ["model", "init", "--arch", arch, "--out", str(out)])
    assert result.exit_code == 0, result.output
    written = modes(out)
    assert "model.safetensors" in written and "config.json" in written
    assert written == dict.fromkeys(written, 0o666 & ~umask)


def test_a_runs_initial_model_folder_and_files_have_the_umasks_modes(
    umask: int, tmp_path: Path
) -> None:
    from roles.lib.model import ensure_tiny_model

    model = ensure_tiny_model(tmp_path / "run", {"hidden_size": 16, "intermediate_size": 32}, 0)
    assert model.stat().st_mode & 0o777 == 0o777 & ~umask
    written = modes(model)
    assert written == dict.fromkeys(written, 0o666 & ~umask)
