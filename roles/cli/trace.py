"""``rlbus trace``: one rollout, its messages and tokens, what caused it and what it caused.

    rlbus trace <run> <rollout-id>     # or a unique prefix of one
    rlbus trace <run> <event-id>       # as `rlbus events` prints it: of a trace.completed, or
                                       # of an eval.completed / samples.scored with one rollout
    rlbus trace <run> <id> --json | --no-tokens

It looks up in the run's trace index (``replay.trace_index``, written with the lake: by
``rlbus up``'s live lake role as the run goes) the stream sequences of the few events the
chain needs, syncing the lake first only when the stream moved past the index (a run
without the live role: its first trace reads the whole log once), fetches only those
messages and hands them to the pure ``replay.inspect.trace_chain``, which builds the
chain it built from a scan of every event of the seven topics (a cost that grew with the
run; ``benchmarks/trace_bench.py`` compares the two). Nothing on this path imports
polars, pyarrow or torch. An id that names no rollout fails in one line (exit 2).
Registered by ``roles.cli``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from roles.cli.common import fail, run_async, run_option, run_paths, server_for

URL = typer.Option(None, "--nats-url", help="NATS URL (default: the run's embedded server).")


async def _load(url: str, run: str, ident: str) -> tuple[str, list[Any]]:
    """(rollout id, the events of its chain) from the run's trace index, the lake synced
    first if the stream moved past it (not after a run whose live lake role kept it)."""
    from bus.runtime import Bus
    from replay.trace_index import sync_if_behind, trace_events
    from roles.cli.progress import progress

    lake = run_paths(run).lake
    bus = await Bus.connect(url, run=run, producer="cli-trace")
    try:
        with progress(f"lake sync {run}", unit="events") as update:
            await sync_if_behind(bus, lake, on_progress=update)
        return await trace_events(bus, lake, ident)
    finally:
        await bus.close()


def trace(
    run: str = run_option(),
    rollout_or_event: str = typer.Argument(
        ..., help="Rollout id (or a unique prefix), or an event id that names one."
    ),
    as_json: bool = typer.Option(False, "--json", help="The chain as one JSON object."),
    tokens: bool = typer.Option(True, "--tokens/--no-tokens", help="Per-token table."),
    nats_url: str | None = URL,
) -> None:
    """One rollout: its messages and tokens, what caused it and what it caused."""
    from rich.console import Console

    from replay.inspect import TraceNotFound, render_chain, trace_chain
    from replay.trace_index import StaleLake

    with server_for(run, nats_url, existing=True) as url:
        try:
            rollout_id, events = run_async(_load(url, run, rollout_or_event))
        except (TraceNotFound, StaleLake) as e:
            fail(str(e))
    chain = trace_chain(events, rollout_id, _token_text(run, events) if tokens else None)
    if as_json:
        typer.echo(json.dumps(chain, default=str))
    else:
        render_chain(chain, Console(highlight=False, soft_wrap=True), tokens=tokens)


def _token_text(run: str, events: list[Any]) -> Any:
    """Token ids -> token strings with the run's tokenizer, or None if it is not here.

    A ``tokenizer.json`` is read with ``tokenizers`` alone: what a fast tokenizer's
    ``convert_ids_to_tokens`` does per id, without importing torch and transformers
    (seconds, most of the command's time). Other tokenizers load through transformers."""
    from schemas import RunStarted

    started = next((e for e in events if isinstance(e, RunStarted)), None)
    for d in (run_paths(run).initial_model, Path(started.model_path) if started else None):
        if d is not None and (d / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            fast = Tokenizer.from_file(str(d / "tokenizer.json"))
            return lambda ids: [fast.id_to_token(i) for i in ids]
        if d is not None and (d / "tokenizer_config.json").is_file():
            from roles.lib.model.loading import load_tokenizer

            tok = load_tokenizer(d)
            return lambda ids: list(tok.convert_ids_to_tokens(ids))
    return None
