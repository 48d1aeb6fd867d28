"""The journal of an ``rlbus eval``: what it asked and each task's answer, written as the
answers come, so an interrupted eval resumes (``rlbus eval --resume``) without asking a
finished task again and reports what an uninterrupted one would.

    journal = EvalJournal.start(path, settings)     # a new eval: (re)writes the file
    journal = EvalJournal.resume(path, settings)    # JournalMismatch naming a setting
    requests, from_seq = journal.ask(requests, version, last_seq)   # before publishing
    journal.answered(eval_completed)                # each answer, flushed at once

The file holds JSON lines, each one record:

- ``{"settings": {...}}``, first: what the eval is keyed on (``eval_settings``): the
  model evaluated, ``k``, and per env in order its task count, sampling, seed root, args,
  max turns and seating. A resume with any of them different is refused, naming the
  first that differs (``JournalMismatch``), and so is one whose run's newest weights
  version differs from the one the interrupted eval asked at (a live run that trained
  meanwhile): the answers would not be of one model;
- ``{"asked": {"version": V, "from_seq": N, "requests": {"<env key>/<task>": id}}}``,
  once, before the first request is published: the version the eval pins, where the
  run's log ended, and each task's request id. A resume asks its unanswered tasks again
  under the same ids (the server drops a republished id it holds; an env server still
  has the request, or its answer is on the log after ``from_seq``), so a task is never
  run twice by the eval;
- ``{"answered": <EvalCompleted>}`` per task, in the order they came.

A task is its env key and task index; its seed is the orchestrator's eval seed of that
task (``roles.up.rollout.build_requests``), so a task asked again samples as before. A
torn last line (the process killed mid-write) is cut off when the journal is resumed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from schemas import EvalCompleted, TaskRequested, derive_id


class JournalMismatch(ValueError):
    """A resume whose settings differ from the interrupted eval's (names the setting)."""


def task_key(env: str, index: int) -> str:
    """One eval task: ``<env key>/<task index>``."""
    return f"{env}/{index}"


def eval_settings(plans: Sequence[Any], k: int, model: str) -> dict[str, Any]:
    """What an eval is keyed on (``plans``: ``roles.up.rollout.Plan`` per env, in order;
    ``model``: the model evaluated, a key or a directory)."""
    return {
        "model": model,
        "k": k,
        "envs": [p.env for p in plans],
        "env": {
            p.env: {
                "tasks": p.groups,
                "sampling": msgspec.to_builtins(p.sampling),
                "seed": p.seed,
                "args": p.env_args,
                "max_turns": p.max_turns,
                "seating": msgspec.to_builtins(p.seating),
            }
            for p in plans
        },
    }


def first_difference(ours: Any, theirs: Any, path: str = "") -> str | None:
    """The dotted name of the first setting that differs (None: none)."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*ours, *(k for k in theirs if k not in ours)]:
            where = f"{path}.{key}" if path else str(key)
            if key not in ours or key not in theirs:
                return where
            if (found := first_difference(ours[key], theirs[key], where)) is not None:
                return found
        return None
    return None if ours == theirs else path or "settings"


def _read(path: Path) -> list[dict[str, Any]]:
    """The journal's records; a torn last line (the process died writing it) is cut off
    the file, so the next record starts a line of its own."""
    records, good = [], 0
    with path.open("rb") as f:
        for line in f:
            try:
                if not line.endswith(b"\n"):
                    raise ValueError("no line end")
                records.append(json.loads(line))
            except ValueError:  # JSONDecodeError is one
                break
            good += len(line)
    if good < path.stat().st_size:
        with path.open("r+b") as f:
            f.truncate(good)
    return records


@dataclass
class EvalJournal:
    path: Path
    settings: dict[str, Any]
    version: int | None = None  # the weights version the eval asked at (None: not asked)
    from_seq: int | None = None  # the log's end before the first request
    requests: dict[str, str] = field(default_factory=dict)  # task -> request id
    answers: dict[str, EvalCompleted] = field(default_factory=dict)  # task -> its answer

    @classmethod
    def start(cls, path: Path, settings: dict[str, Any]) -> EvalJournal:
        """A new eval's journal (an earlier one at ``path`` is replaced)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        journal = cls(path, settings)
        path.write_text(json.dumps({"settings": settings}) + "\n")
        return journal

    @classmethod
    def resume(cls, path: Path, settings: dict[str, Any]) -> EvalJournal:
        """The interrupted eval's journal; ``JournalMismatch`` when ``settings`` differ
        from its own, or there is none."""
        records = _read(path) if path.is_file() else []
        if not records or "settings" not in records[0]:
            raise JournalMismatch(f"no interrupted eval to resume at {path}")
        theirs = records[0]["settings"]
        if (diff := first_difference(settings, theirs)) is not None:
            raise JournalMismatch(
                f"{diff} differs from the interrupted eval's ({_at(settings, diff)} here, "
                f"{_at(theirs, diff)} there, {path}); give the same settings, or drop "
                "--resume to start over"
            )
        journal = cls(path, settings)
        decode = msgspec.json.Decoder(EvalCompleted)
        for record in records[1:]:
            if asked := record.get("asked"):
                journal.version, journal.from_seq = asked["version"], asked["from_seq"]
                journal.requests = dict(asked["requests"])
            elif "answered" in record:
                answer = decode.decode(json.dumps(record["answered"]))
                journal.answers.setdefault(task_key(answer.env, answer.task_index), answer)
        return journal

    def ask(
        self, requests: Sequence[TaskRequested], version: int, last_seq: int
    ) -> tuple[list[TaskRequested], int]:
        """The requests still to publish and the log sequence to read answers after:
        every task's the first time (recorded, with ``version`` and ``last_seq``); on a
        resume, the unanswered tasks' under their first ids, read from the first
        ``last_seq`` (``JournalMismatch`` when the run's newest ``version`` moved)."""
        if self.version is None:
            self.version, self.from_seq = version, last_seq
            self.requests = {task_key(r.env, r.task.index): r.event_id for r in requests}
            asked = {"version": version, "from_seq": last_seq, "requests": self.requests}
            self._append({"asked": asked})
        elif version != self.version:
            raise JournalMismatch(
                f"the weights version differs from the interrupted eval's (v{version} "
                f"here, v{self.version} there, {self.path}): the run trained meanwhile; "
                "drop --resume to start over"
            )
        assert self.from_seq is not None
        todo = []
        for r in requests:
            key = task_key(r.env, r.task.index)
            if key in self.answers:
                continue
            event_id = self.requests.get(key, r.event_id)
            todo.append(
                msgspec.structs.replace(r, event_id=event_id, group_id=derive_id(event_id, "group"))
            )
        return todo, self.from_seq

    def answered(self, answer: EvalCompleted) -> None:
        """Record one task's answer (once per task), on disk before this returns."""
        key = task_key(answer.env, answer.task_index)
        if key in self.answers:
            return
        self.answers[key] = answer
        self._append({"answered": msgspec.to_builtins(answer)})

    def _append(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()


def _at(settings: Any, dotted: str) -> str:
    node = settings
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return "unset"
        node = node[part]
    return json.dumps(node)
