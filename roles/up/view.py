"""The live terminal view of ``rlbus up`` (rich), or one plain line per step without a TTY."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table

from roles.up.monitor import RunMonitor, sparkline


class LiveView:
    def __init__(self, monitor: RunMonitor, roles: list[Any], enabled: bool = True):
        self.m = monitor
        self.roles = roles
        self.enabled = enabled and sys.stdout.isatty()
        self.notes: list[str] = []
        self.live: Live | None = None
        self.printed_step = 0
        self.printed_eval: set[int] = set()

    def __enter__(self) -> LiveView:
        if self.enabled:
            self.live = Live(
                self.render(), console=Console(), refresh_per_second=2, transient=False
            )
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is None:
            self.print_lines(final=True)
        if self.live is not None:
            self.live.update(self.render())
            self.live.__exit__(None, None, None)

    def note(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {text}")
        del self.notes[:-5]
        if not self.enabled:
            print(f"[rlbus] {text}", flush=True)

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())
            return
        self.print_lines()

    def print_lines(self, final: bool = False) -> None:
        """Plain mode: one line per trained step (once the trainer reported it)."""
        m = self.m
        ready = m.train if final else m.trainer
        for step in sorted(s for s in ready if s > self.printed_step and s in m.train):
            t, tr = m.train[step], m.trainer.get(step, {})
            print(
                f"[rlbus] step {step:>4}/{m.max_steps} {'sft' if t.get('sft') else 'rl '} "
                f"reward {t.get('reward_mean', 0):.3f} staleness {t.get('staleness_mean', 0):.2f} "
                f"policy v{m.policy_version} loss {tr.get('loss', float('nan')):.4f} "
                f"rollouts/s {m.rollouts_per_s():.1f}",
                flush=True,
            )
            self.printed_step = step
        for v in sorted(set(m.eval) - self.printed_eval):
            vals = " ".join(f"{k} {x:.3f}" for k, x in sorted(m.eval[v].items()) if "@" in k)
            print(f"[rlbus] eval at policy v{v}: {vals}", flush=True)
            self.printed_eval.add(v)

    def render(self) -> Panel:
        m = self.m
        head = Table.grid(padding=(0, 2))
        head.add_column(style="bold")
        head.add_column()
        # Warm-start batches are the teacher's answers (reward 1 by construction): RL only.
        rewards = [v for k, v in m.series(m.train, "reward_mean") if not m.train[k].get("sft")]
        elapsed = time.monotonic() - m.started_at
        tps = m.last(m.trainer, "tokens_per_s")
        head.add_row("step", f"{m.assembled}/{m.max_steps} ({m.phase})   elapsed {elapsed:.0f}s")
        head.add_row(
            "policy", f"v{m.policy_version}   lag {max(0, m.assembled - m.policy_version)} step(s)"
        )
        head.add_row("train reward", f"{rewards[-1]:.3f}  {sparkline(rewards)}" if rewards else "-")
        for key in m.eval_keys():
            pts = [v for _, v in m.series(m.eval, key)]
            head.add_row(f"eval {key}", f"{pts[-1]:.3f}  {sparkline(pts)}  (at v{max(m.eval)})")
        head.add_row("rollouts/s", f"{m.rollouts_per_s():.1f}   total {m.rollouts}")
        head.add_row(
            "trainer",
            f"{tps:.0f} tokens/s   loss {m.last(m.trainer, 'loss') or 0:.4f}" if tps else "-",
        )
        roles = Table("role", "state", "restarts", box=None, padding=(0, 1))
        for r in self.roles:
            state = "[green]running[/]" if r.alive else "[red]down[/]"
            roles.add_row(r.name, state, str(r.restarts) if r.restarts else "")
        parts: list[Any] = [head, roles]
        if self.notes:
            parts.append("\n".join(self.notes))
        return Panel(Group(*parts), title=f"rlbus · {m.run}", subtitle="Ctrl-C drains and stops")

    def final_report(self, summary: dict[str, Any], path: Path, curves: Path | None) -> str:
        lines = [f"run {summary['run']}: {summary.get('stopped') or 'interrupted'}"]
        for k, v in summary.items():
            if ":" in k and v is not None:
                lines.append(f"  {k} = {v:.3f}" if isinstance(v, float) else f"  {k} = {v}")
        lines.append(f"  summary: {path}")
        if curves:
            lines.append(f"  curves:  {curves}")
        return "\n".join(lines)
