"""docs/configuration.md names every bundled preset, so the list cannot drift again
(issue 31: `debate` and `qwen3-tiny` were missing from it)."""

from __future__ import annotations

from pathlib import Path

from configs import list_presets

ROOT = Path(__file__).resolve().parents[2]


def test_every_preset_is_named_in_the_configuration_docs_presets_list() -> None:
    doc = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    presets = doc.split("\nPresets:", 1)[1].split("\n\n", 1)[0]  # the one paragraph
    on_disk = sorted(p.stem for p in (ROOT / "configs" / "presets").glob("*.toml"))
    assert on_disk == list_presets() and len(on_disk) >= 6
    assert [name for name in on_disk if f"`{name}`" not in presets] == []
