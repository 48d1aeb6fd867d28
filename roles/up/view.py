"""The live terminal view of ``rlbus up`` (rich), or one plain line per step without a TTY.

Both show the run's phase (starting, warm start (sft), rl, stopped), each role's state
(starting: no heartbeat yet, running, silent: no heartbeat for a while, down, retiring:
a pool replica draining before it leaves, draining, stopped), notes (a role restarted,
with the last error of its log; a role silent or beating again; the nats-server
restarted; a pool resized; the run stalled; why the run stopped) and, at the end, a
short report of the run (``final_report``). The live view also shows each pool
(``roles.up.pools``): its replicas, bounds and load (an env's backlog), and beside the
rollout rate (rollouts that can train) the errored and filtered counts. Rewards and
eval scores in 0..1 are drawn on a fixed 0..1 scale.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from rich.console import Console, Group
from rich.live import Live
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from roles.up.monitor import RunMonitor, score_sparkline


class PoolRows(Protocol):
    def rows(self) -> list[tuple[str, str, str]]: ...


class LiveView:
    def __init__(self, monitor: RunMonitor, roles: list[Any], enabled: bool = True):
        self.m = monitor
        self.roles = roles
        self.enabled = enabled and sys.stdout.isatty()
        self.notes: list[str] = []
        self.live: Live | None = None
        self.printed_step = 0
        self.printed_eval: set[int] = set()
        self.printed_phase: str | None = None
        self.states: dict[str, str] = {}  # the supervisor's word on a role: draining, stopped
        self.silent: dict[str, float] = {}  # role -> its last heartbeat (time.time()), while silent
        self.stop_reason: str | None = None  # set once the roles are being stopped
        self.pools: PoolRows | None = None  # (pool, replicas, load) rows: roles.up.pools
        # Role names whose process has beaten in the registry (None: not read yet); a
        # live role not among them is still starting (loading a model, connecting).
        self.beating: set[str] | None = None

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

    def detach(self) -> None:
        """The terminal closed: stop drawing; plain lines from now on (the launcher sends
        its output to its log file)."""
        if self.live is not None:
            with contextlib.suppress(Exception):
                self.live.stop()
            self.live = None
        self.enabled = False

    def note(self, text: str) -> None:
        self.notes.append(f"{time.strftime('%H:%M:%S')} {text}")
        del self.notes[:-5]
        if not self.enabled:
            print(f"[rlbus] {text}", flush=True)

    def stopping(self, reason: str) -> None:
        """The run is over (``reason``): the roles are stopped in order from now on."""
        self.stop_reason = reason
        self.refresh()
        if not self.enabled:
            print(f"[rlbus] stopping ({reason}): draining the roles in order", flush=True)

    def role_state(self, name: str, state: str) -> None:
        """A role's state as the supervisor sees it while stopping (draining, stopped)."""
        self.states[name] = state
        if not self.enabled:
            print(f"[rlbus]   {name}: {state}", flush=True)
        self.refresh()

    def silence(self, name: str, last_beat: float | None) -> None:
        """A role stopped beating at ``last_beat`` (``time.time()``), or beats again (None):
        its state reads ``silent <n>s`` meanwhile."""
        if last_beat is None:
            self.silent.pop(name, None)
        else:
            self.silent[name] = last_beat

    def refresh(self) -> None:
        if self.live is not None:
            self.live.update(self.render())
            return
        self.print_lines()

    def print_lines(self, final: bool = False) -> None:
        """Plain mode: one line per trained step (once the trainer reported it)."""
        m = self.m
        if not final and (phase := m.phase_label()) != self.printed_phase:
            print(f"[rlbus] phase: {phase}", flush=True)
            self.printed_phase = phase
        ready = m.train if final else m.trainer
        kept_out = f" errored {m.errored} filtered {m.filtered}" if m.trainable is not None else ""
        for step in sorted(s for s in ready if s > self.printed_step and s in m.train):
            t, tr = m.train[step], m.trainer.get(step, {})
            print(
                f"[rlbus] step {step:>4}/{m.max_steps} {'sft' if t.get('sft') else 'rl '} "
                f"reward {t.get('reward_mean', 0):.3f} staleness {t.get('staleness_mean', 0):.2f} "
                f"policy v{m.policy_version} loss {tr.get('loss', float('nan')):.4f} "
                f"rollouts/s {m.rollouts_per_s():.1f}{kept_out}",
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
        rewards = [v for k, v in m.series(m.train, "reward_mean") if not m.train[int(k)].get("sft")]
        rollouts = rollouts_text(m)
        elapsed = time.monotonic() - m.started_at
        tps = m.last(m.trainer, "tokens_per_s")
        head.add_row("phase", self.phase_text())
        head.add_row("step", f"{m.assembled}/{m.max_steps}   elapsed {elapsed:.0f}s")
        head.add_row(
            "policy", f"v{m.policy_version}   lag {max(0, m.assembled - m.policy_version)} step(s)"
        )
        head.add_row(
            "train reward", f"{rewards[-1]:.3f}  {score_sparkline(rewards)}" if rewards else "-"
        )
        for key in m.eval_keys():
            pts = [v for _, v in m.series(m.eval, key)]
            head.add_row(
                f"eval {key}", f"{pts[-1]:.3f}  {score_sparkline(pts)}  (at v{max(m.eval)})"
            )
        head.add_row(
            "rollouts",
            f"{rollouts}   eval {m.eval_rollouts} (k={m.eval_k} per eval task, not in the rate)",
        )
        if m.erroring:
            head.add_row("[red]erroring[/]", f"[red]{escape(m.erroring)}[/]")
        if m.stall:
            head.add_row("[yellow]stalled[/]", f"[yellow]{escape(m.stall)}[/]")
        head.add_row(
            "trainer",
            f"{tps:.0f} tokens/s   loss {m.last(m.trainer, 'loss') or 0:.4f}" if tps else "-",
        )
        roles = Table("role", "state", "restarts", box=None, padding=(0, 1))
        for r in self.roles:
            roles.add_row(r.name, self.styled_state(r), str(r.restarts) if r.restarts else "")
        parts: list[Any] = [head, roles]
        if self.pools is not None and (rows := self.pools.rows()):
            pools = Table("pool", "replicas", "load", box=None, padding=(0, 1))
            for row in rows:
                pools.add_row(*row)
            parts.append(pools)
        if self.notes:
            parts.append("\n".join(self.notes))
        subtitle = "the roles drain in order" if self.stop_reason else "Ctrl-C drains and stops"
        return Panel(Group(*parts), title=f"rlbus · {m.run}", subtitle=subtitle)

    def phase_text(self) -> str:
        """The monitor's phase (while starting, how many roles beat), or while stopping
        why and which roles are draining."""
        if self.stop_reason is None:
            label = self.m.phase_label()
            if self.m.started is None and self.m.stopped is None:
                beating = len(self.beating or ())
                if not beating:
                    return f"{label}: roles loading, waiting for the first heartbeat"
                return f"{label}: {beating} of {len(self.roles)} roles beating"
            return label
        if not any(r.alive for r in self.roles):
            return f"stopped ({self.stop_reason}): every role stopped"
        draining = [name for name, state in self.states.items() if state == "draining"]
        now = f": draining {', '.join(draining)}" if draining else ""
        return f"stopping ({self.stop_reason}){now}"

    def styled_state(self, role: Any) -> str:
        state = self.states.get(role.name) or ("running" if role.alive else "down")
        if state == "running" and getattr(role, "retiring_since", None) is not None:
            state = "retiring"
        if state == "running" and self.beating is not None and role.name not in self.beating:
            state = "starting"  # alive, never beat: loading its model, connecting
        if state == "running" and role.name in self.silent:
            state = f"silent {time.time() - self.silent[role.name]:.0f}s"
        style = STATE_STYLES.get(state.split(" ")[0], "")
        return f"[{style}]{state}[/]" if style else state

    def final_report(
        self, summary: dict[str, Any], path: Path, curves: Path | None, logs: Path | None = None
    ) -> str:
        """The run in a few aligned lines: how it ended, steps, eval, counts, files."""
        rows = [("result", outcome(summary)), ("steps", self.steps_text(summary))]
        rows += [(f"eval {key}", self.eval_text(key)) for key in self.m.eval_keys()]
        restarts = ", ".join(f"{k} {n}" for k, n in summary.get("restarts", {}).items())
        rows += [
            ("rollouts", self.rollouts_text(summary)),
            ("throughput", throughput_text(summary)),
            ("restarts", restarts or "none"),
            ("summary", str(path)),
            ("curves", str(curves) if curves else "none (nothing was reported)"),
        ]
        if logs is not None:
            rows.append(("logs", f"{logs}/<role>.log"))
        width = max(len(k) for k, _ in rows)
        return "\n".join(
            [f"rlbus run {summary['run']}"] + [f"  {k:<{width}}  {v}" for k, v in rows]
        )

    def rollouts_text(self, summary: dict[str, Any]) -> str:
        m = self.m
        evals = f"{summary['eval_rollouts']} eval ({m.eval_tasks} eval tasks x k={m.eval_k})"
        return f"{summary['rollouts']} train, {evals}"

    def steps_text(self, summary: dict[str, Any]) -> str:
        steps, warm = summary["steps"], min(summary["steps"], self.m.warmup_steps)
        split = f" ({warm} warm start, {steps - warm} rl)" if self.m.warmup_steps else ""
        return f"{steps}/{self.m.max_steps} trained{split}   wall {summary['wall_s']:.0f}s"

    def eval_text(self, key: str) -> str:
        """start -> after the warm start -> final, each with its policy version."""
        points = self.m.series(self.m.eval, key)
        at = dict(points)
        warm = self.m.warmup_steps
        parts = []

        def score(version: int) -> str:
            err = self.m.stderr(key, version)
            return f"{at[version]:.3f}" + ("" if err is None else f" ± {err:.3f}")

        if 0 in at:
            parts.append(f"{score(0)} at start")
        if warm and warm in at:
            parts.append(f"{score(warm)} after warm start (v{warm})")
        if points and points[-1][0] not in (0, warm):
            version = int(points[-1][0])
            parts.append(f"{score(version)} final (v{version})")
        return " -> ".join(parts) or "-"


STATE_STYLES = {
    "starting": "cyan",
    "running": "green",
    "silent": "yellow",
    "down": "red",
    "draining": "yellow",
    "retiring": "yellow",
    "stopped": "dim",
    "killed": "red",
}


def outcome(summary: dict[str, Any]) -> str:
    """How the run ended: failed, stopped by the orchestrator, or interrupted."""
    if summary.get("failed"):
        return f"FAILED: {summary['failed']}"
    stopped = summary.get("stopped")
    if stopped:
        return f"stopped: {stopped['reason']}" + (
            f" ({stopped['detail']})" if stopped["detail"] else ""
        )
    interrupted = (
        f"interrupted ({summary.get('interrupted') or 'signal'}) at step {summary['steps']}"
    )
    resume = summary.get("resume")
    return f"{interrupted}; continue with: {resume}" if resume else interrupted


def throughput_text(summary: dict[str, Any]) -> str:
    """Train rollouts/s (those that can train, once the orchestrator said how many),
    the errored and filtered ones beside it, and the trainer's tokens/s."""
    tokens = summary.get("trainer_tokens_per_s")
    trainer = f"; trainer {tokens:.0f} tokens/s" if tokens else ""
    errored, filtered = summary.get("errored_rollouts"), summary.get("filtered_rollouts")
    kept_out = (
        f" ({errored} errored, {filtered} filtered: not in the rate)"
        if errored is not None and filtered is not None
        else ""
    )
    return f"{summary['rollouts_per_s']:.1f} train rollouts/s{kept_out}{trainer}"


def rollouts_text(m: RunMonitor) -> str:
    """The live view's train rollouts: completed, the rate of those that can train, and
    the errored and filtered ones (once the orchestrator has said how many)."""
    if m.trainable is None:
        return f"{m.rollouts} train, {m.rollouts_per_s():.1f}/s"
    errored = f"[red]{m.errored} errored[/]" if m.errored else "0 errored"
    return (
        f"{m.rollouts} train, {m.rollouts_per_s():.1f}/s that can train   "
        f"{errored}, {m.filtered} filtered"
    )
