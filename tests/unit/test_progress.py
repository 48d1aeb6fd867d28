"""The progress helper of long commands (``roles.cli.progress``): plain lines when stderr
is not a terminal, a rich bar when it is, nothing at all when there was nothing to do."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from roles.cli import progress as progress_module
from roles.cli.progress import progress


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """A clock the test moves by hand (``clock.now``), seen only by the helper."""
    fake = SimpleNamespace(now=0.0)
    monkeypatch.setattr(progress_module, "time", SimpleNamespace(monotonic=lambda: fake.now))
    return fake


def test_plain_lines_every_few_seconds_and_a_last_one(
    clock: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """Off a terminal: one line per ``every_s`` however often it is updated, and a last
    line with the final count; stdout stays empty (it may carry data)."""
    with progress("lake sync r1", total=20, unit="events", every_s=5.0, terminal=False) as update:
        for done in range(1, 21):
            clock.now = done * 0.6  # 12 s in all: lines at 5.4 s and 5 s later, at 10.8 s
            update(done)
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.splitlines() == [
        "lake sync r1: 9/20 events (45%)",
        "lake sync r1: 18/20 events (90%)",
        "lake sync r1: 20/20 events (100%)",
    ]


def test_plain_last_line_not_repeated_and_total_from_update(
    clock: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    """A total may arrive with an update (the library learns it); a last line that would
    repeat the previous one is not written."""
    with progress("export r1", terminal=False) as update:
        clock.now = 6.0
        update(3, total=10)
    assert capsys.readouterr().err == "export r1: 3/10 (30%)\n"
    with progress("read r1", unit="events", terminal=False) as update:
        update(7)  # no total known: the count alone
    assert capsys.readouterr().err == "read r1: 7 events\n"


@pytest.mark.parametrize("terminal", [False, True])
def test_nothing_to_do_draws_nothing(terminal: bool, capsys: pytest.CaptureFixture[str]) -> None:
    """Never updated (``rlbus sql`` on an up-to-date lake): not a line, not a bar."""
    with progress("lake sync r1", total=None, unit="events", terminal=terminal):
        pass
    assert capsys.readouterr() == ("", "")


def test_terminal_bar_renders_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    """The rich bar, forced on a stderr that is no terminal, renders its last state there
    (and only there) without error."""
    with progress("replay r1 trainer", total=None, unit="steps", terminal=True) as update:
        for done in range(1, 5):
            update(done, total=4)
    out = capsys.readouterr()
    assert out.out == ""
    assert "replay r1 trainer" in out.err and "4/4" in out.err and "steps" in out.err
