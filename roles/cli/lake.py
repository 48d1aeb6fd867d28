"""``rlbus lake sync|info`` and ``rlbus sql``: a run's Parquet lake, and SQL over it.

    rlbus lake sync --run smoke1                   # materialise new events (idempotent)
    rlbus lake info --run smoke1                   # parts, rows and position per table
    rlbus sql --run smoke1 "select step, avg(reward) from rollouts group by step"
    rlbus sql --run smoke1 -f csv -o rewards.csv "select * from rollouts"
    rlbus sql --run smoke1                         # interactive: end statements with ';'

``rlbus sql`` syncs first, through the run's server (``--nats-url``, its running
embedded server, or one started on its store), whenever the run's stream holds events
past the lake's position (``replay.lake.sync_if_behind``): a finished run's log can still
grow, e.g. by a shadow ``rlbus algorithm attach``. Then it queries the views of
``replay.sql`` (docs/analytics.md). Without ``--run`` it covers every run under the data
directory; ``--run`` on a run that is neither here nor on the server fails in one line.
A sync shows its progress on stderr (``roles.cli.progress``), so query output on stdout
stays clean.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import typer

from roles.cli.common import fail, local_runs, no_run, run_async, run_option, server_for

if TYPE_CHECKING:
    import duckdb
    import polars as pl

lake_app = typer.Typer(help="The run's Parquet lake (runs/<run>/lake).", no_args_is_help=True)

DATA = typer.Option(None, "--data-dir", help="Runs directory (default: $RLBUS_DATA_DIR or runs).")
URL = typer.Option(None, "--nats-url", help="NATS URL (default: the run's embedded server).")
FORMATS = ("table", "csv", "json", "parquet")
MAX_PRINTED = 1000  # rows a terminal table shows


def _data_dir(data_dir: str | None) -> Path:
    from configs.paths import resolve_data_dir

    return resolve_data_dir(data_dir)


@lake_app.command("sync")
def sync(
    run: str = run_option(),
    nats_url: str | None = URL,
    data_dir: str | None = DATA,
) -> None:
    """Append the run's new events to its lake (reads from the last synced sequence)."""
    from replay.lake import sync as sync_run
    from roles.cli.progress import progress

    root = _data_dir(data_dir)
    with server_for(run, nats_url, root, existing=True) as url:
        with progress(f"lake sync {run}", unit="events") as update:
            r = run_async(sync_run(run, url, root, on_progress=update))
    rows = ", ".join(f"{t} {n}" for t, n in sorted(r.rows.items())) or "no new rows"
    typer.echo(f"{run}: {r.events} events (seq {r.start_seq}..{r.last_seq}) in {r.seconds:.2f}s: {rows}")  # fmt: skip
    for s in r.skipped:
        typer.echo(f"  skipped seq {s.seq} ({s.schema} on {s.subject}): {s.reason}", err=True)


@lake_app.command("info")
def info(run: str = run_option(), data_dir: str | None = DATA) -> None:
    """Parts, rows and last synced sequence of every table of a run's lake."""
    import polars as pl
    from rich.console import Console
    from rich.table import Table

    from replay.lake import lake_dir, load_state, parts
    from replay.tables import TABLES

    root = _data_dir(data_dir)
    lake = lake_dir(root, run)
    if not lake.exists():
        if run not in local_runs(root):
            no_run(run, f"no run data under {root}", local_runs(root))
        fail(f"no lake at {lake}: run `rlbus lake sync --run {run}`")
    state = load_state(lake)
    table = Table("table", "parts", "rows", "synced to seq", title=f"lake of {run}")
    for t in TABLES:
        files = [p for _, _, p in parts(lake, t)]
        n = pl.scan_parquet(files).select(pl.len()).collect().item() if files else 0
        table.add_row(t, str(len(files)), str(n), str(state["tables"][t]))
    Console().print(table)


def sync_before_query(run: str, root: Path, nats_url: str | None, *, named: bool) -> None:
    """Bring ``run``'s lake up to its stream before a query, when the stream moved on.

    ``named`` (``--run``): a run with neither a lake here nor a stream on its server is a
    typo, and fails in one line. Otherwise a run that cannot be synced is queried as its
    lake is: silently when there is no server or store (the lake is all there is here,
    e.g. copied alone), with a warning when the stream is missing or the lake is locked."""
    from configs.paths import RunPaths
    from replay import sync_lake
    from roles.cli.progress import progress

    if named and not RunPaths(root, run).lake.is_dir():
        with server_for(run, nats_url, root, existing=True):
            pass  # a typo fails here, in one line
    try:
        with progress(f"lake sync {run}", unit="events") as update:  # stderr: stdout is data
            sync_lake(run, root, nats_url, on_progress=update)  # None: no server or store
    except (LookupError, OSError) as e:
        typer.echo(f"warning: could not sync {run}: {e}", err=True)


def _flat(frame: pl.DataFrame) -> pl.DataFrame:
    """Nested columns (lists, maps, structs) as JSON text, for CSV and the terminal."""
    import polars as pl

    nested = [c for c, t in frame.schema.items() if t.is_nested()]
    return frame.with_columns(
        pl.Series(c, [json.dumps(v) for v in frame[c].to_list()], dtype=pl.String) for c in nested
    )


def _print_table(frame: pl.DataFrame, out: TextIO) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(*frame.columns)
    for row in _flat(frame.head(MAX_PRINTED)).iter_rows():
        table.add_row(*("NULL" if v is None else str(v) for v in row))
    Console(file=out).print(table)
    shown = f", first {MAX_PRINTED} shown: use -f csv for all" if frame.height > MAX_PRINTED else ""
    out.write(f"({frame.height} rows{shown})\n")


def emit(frame: pl.DataFrame, fmt: str, out: str | None) -> None:
    """Write a result as a table (terminal), CSV, JSON (an array of objects) or Parquet."""
    if fmt == "parquet":
        if out is None:
            raise typer.BadParameter("--format parquet needs --out FILE")
        frame.write_parquet(out)
    elif fmt == "table" and out is None:
        _print_table(frame, sys.stdout)
    else:  # csv (also "table" into a file) or json
        text = _flat(frame).write_csv() if fmt in ("csv", "table") else frame.write_json() + "\n"
        if out is None:
            sys.stdout.write(text)
        else:
            Path(out).write_text(text)


def repl(con: duckdb.DuckDBPyConnection, stdin: TextIO, fmt: str = "table") -> None:
    """Read statements ending with ';' until ``.quit`` or end of input; ``.tables`` lists views."""
    import duckdb

    from replay.sql import run_query, views

    tty = stdin.isatty()
    buffer: list[str] = []
    while True:
        if tty:
            sys.stdout.write("rlbus> " if not buffer else "   ...> ")
            sys.stdout.flush()
        line = stdin.readline()
        if not line:
            break
        stripped = line.strip()
        if not buffer and stripped in (".quit", ".exit"):
            break
        if not buffer and stripped == ".tables":
            sys.stdout.write("\n".join(views(con)) + "\n")
            continue
        if stripped:
            buffer.append(line)
        if buffer and stripped.endswith(";"):
            statement, buffer = "".join(buffer), []
            try:
                frame = run_query(con, statement)
            except duckdb.Error as e:
                sys.stdout.write(f"error: {e}\n")
                continue
            if frame is not None:
                emit(frame, fmt, None)


def sql(
    query: str | None = typer.Argument(None, help="SQL; without it, an interactive shell."),
    run: str | None = run_option(None, "Run id (default: every run)."),
    fmt: str = typer.Option("table", "--format", "-f", help="table | csv | json | parquet."),
    out: str | None = typer.Option(None, "--out", "-o", help="Write the result to this file."),
    no_sync: bool = typer.Option(False, "--no-sync", help="Query the lake as it is."),
    nats_url: str | None = URL,
    data_dir: str | None = DATA,
) -> None:
    """Query runs' lakes with DuckDB SQL (views: see docs/analytics.md)."""
    import duckdb

    from configs.paths import RunPaths
    from replay.sql import connect, run_query

    if fmt not in FORMATS:
        raise typer.BadParameter(f"--format must be one of {', '.join(FORMATS)}")
    root = _data_dir(data_dir)
    if no_sync:
        if run is not None and not RunPaths(root, run).lake.is_dir():
            no_run(run, f"no lake at {RunPaths(root, run).lake}, and --no-sync", local_runs(root))
    else:
        for r in [run] if run else local_runs(root):
            sync_before_query(r, root, nats_url, named=run is not None)
    con = connect(root, run)
    try:
        if query is None:
            repl(con, sys.stdin, fmt)
            return
        try:
            frame = run_query(con, query)
        except duckdb.Error as e:
            raise typer.BadParameter(str(e), param_hint="QUERY") from None
        if frame is not None:
            emit(frame, fmt, out)
    finally:
        con.close()
