"""``rlbus up --resume`` with changed keys: which keys it may change, when a finished run
trains on, and how the orchestrator's fold and the launcher's monitor read the resumed
segment (pure: no server; the whole path runs in tests/e2e/test_resume_extend.py)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import typer

from configs import RunConfig, dump_toml
from configs.paths import RunPaths
from roles.cli.core import _resumed_config
from roles.orchestrator.policy import decide
from roles.orchestrator.state import OrchestratorState
from roles.up.monitor import RunMonitor
from roles.up.run_guard import (
    RESUMABLE,
    PreviousRun,
    RunRefused,
    check_previous,
    previous_run,
    resume_override_problem,
)
from schemas import (
    BatchAssembled,
    EvalCompleted,
    Event,
    RunStarted,
    RunStopped,
    TaskRequested,
    run_resumed_id,
    run_stopped_id,
)
from tests.unit.test_orchestrator import make, scored, started, step, weights

# -- which keys --resume may change ---------------------------------------------------------


def test_resume_takes_the_resumable_keys_and_names_any_other() -> None:
    assert "max_steps" in RESUMABLE
    assert resume_override_problem(["max_steps=600", "bus.data_dir=/tmp/x"]) is None
    assert resume_override_problem([f"{key}=1" for key in RESUMABLE]) is None
    said = resume_override_problem(["max_steps=600", "trainer.lr=1e-4"])
    assert said is not None and said.startswith("--resume cannot change trainer.lr:")
    assert "max_steps" in said  # ... and says what it may change


def _finished(data: Path, run: str, *, steps: int, reason: str | None = "max_steps") -> RunPaths:
    paths = RunPaths(data, run)
    paths.dir.mkdir(parents=True)
    paths.config.write_text(dump_toml(RunConfig(max_steps=steps)))
    stopped = {"reason": reason, "detail": ""} if reason else None
    if reason != "killed":  # a launcher killed with SIGKILL writes no summary
        paths.summary.write_text(json.dumps({"stopped": stopped, "steps": steps}))
    return paths


def _refusal(paths: RunPaths, max_steps: int | None) -> str:
    with pytest.raises(RunRefused) as refused:
        check_previous(paths, "resume", previous_run(paths), max_steps)
    return str(refused.value)


def test_a_finished_run_resumes_only_to_train_on(tmp_path: Path) -> None:
    """Stopped at max_steps: resumes with a higher max_steps; the same, a lower one or
    none is refused in one line that says what to raise."""
    paths = _finished(tmp_path, "done", steps=6)
    check_previous(paths, "resume", previous_run(paths), 8)  # trains steps 7 and 8
    for same_or_lower in (6, 3, None):
        said = _refusal(paths, same_or_lower)
        assert "finished (max_steps at step 6): nothing to resume" in said
        assert "\n" not in said
    assert "raise max_steps above 6" in _refusal(paths, 6)


def test_a_run_stopped_for_another_reason_is_not_resumed(tmp_path: Path) -> None:
    paths = _finished(tmp_path, "stalled", steps=3, reason="stalled")
    said = _refusal(paths, 10)
    assert "finished (stalled at step 3): nothing to resume" in said
    assert "raise max_steps" not in said  # more steps would not help


def test_an_interrupted_run_is_refused_a_max_steps_below_its_steps(tmp_path: Path) -> None:
    paths = _finished(tmp_path, "cut", steps=5, reason=None)
    check_previous(paths, "resume", previous_run(paths), 5)  # finish what is there
    check_previous(paths, "resume", previous_run(paths), 9)
    assert "trained 5 steps: max_steps = 4 is below them" in _refusal(paths, 4)


def test_a_killed_run_counts_its_steps_by_its_newest_checkpoint(tmp_path: Path) -> None:
    paths = _finished(tmp_path, "killed", steps=7, reason="killed")
    for n in (4, 6):
        paths.checkpoint(n).mkdir(parents=True)
        (paths.checkpoint(n) / "state.json").write_text("{}")
    assert previous_run(paths) == PreviousRun(stopped=None, steps=None)
    assert "trained 6 steps" in _refusal(paths, 5)
    check_previous(paths, "resume", previous_run(paths), 6)


def test_the_cli_refuses_a_key_resume_cannot_change_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    paths = _finished(tmp_path, "r", steps=6)
    data = f"bus.data_dir={tmp_path}"
    assert _resumed_config("default", [data, "max_steps=9"], "r", True, False) == str(paths.config)
    for config, overrides, says in (
        ("default", [data, "trainer.lr=0.1"], "rlbus up: --resume cannot change trainer.lr: "),
        ("smoke", [data], "drop -c and overrides"),
    ):
        with pytest.raises(typer.Exit) as exit_:
            _resumed_config(config, overrides, "r", True, False)
        assert exit_.value.exit_code == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert says in line


# -- the orchestrator's fold over a resumed run ----------------------------------------------


def _drive(state: OrchestratorState, cfg_of, first: Event) -> list[Event]:  # noqa: ANN001
    """Answer every train dispatch with scores and every batch with its weights until the
    run stops; ``cfg_of(state)`` is the config the role decides under (its config in force)."""
    log: list[Event] = []  # in the order a stream would hold them
    todo: list[Event] = [first]
    while todo:
        event = todo.pop(0)
        out = step(state, cfg_of(state), event)
        log += [event, *out]
        if any(isinstance(e, RunStopped) for e in out):
            return log
        for e in out:
            if isinstance(e, TaskRequested) and e.phase == "rl":
                todo.append(scored(e, [0.0, 1.0, 0.0, 1.0], policy=e.policy_version))
            elif isinstance(e, TaskRequested) and e.phase == "eval":
                todo.append(answer(e))
            elif isinstance(e, BatchAssembled):
                todo.append(weights(e.step))
        assert len(log) < 1000
    raise AssertionError("the run never stopped")


def answer(request: TaskRequested) -> EvalCompleted:
    return EvalCompleted(
        run="r", event_id=f"answer-{request.event_id}", request_id=request.event_id,
        env=request.env, step=request.step, task_index=request.task.index, rewards=[1.0],
    )  # fmt: skip


def _resumed(cfg: RunConfig, segment: int) -> RunStarted:
    return RunStarted(
        run="r", event_id=run_resumed_id("r", segment), config=cfg.model_dump(mode="json"),
        seed=cfg.seed, model_path="m", resumed=True,
    )  # fmt: skip


def test_a_resumed_start_trains_a_stopped_run_on_and_the_log_refolds_the_same() -> None:
    """Stopped at max_steps 2, a resumed start with max_steps 4 opens segment 1: the fold
    forgets the stop, trains steps 3 and 4 and stops with segment 1's id. Re-folding the
    whole log under each segment's config makes no decision that is not on it, and
    re-makes every one that is (v2 was evaluated as the final version of segment 0: under
    max_steps 4 alone it would not be, and its eval requests would look forged)."""
    evals = ("orchestrator.eval.interval=3", "orchestrator.eval.num_tasks=1")
    old, state = make("max_steps=2", *evals)
    new, _ = make("max_steps=4", *evals)
    first = _drive(state, lambda s: old, started(old))
    (stop,) = [e for e in first if isinstance(e, RunStopped)]
    assert stop.event_id == run_stopped_id("r") and stop.step == 2
    resume = _resumed(new, 1)
    assert state.check(resume) is None
    second = _drive(state, lambda s: new, resume)
    assert state.segment == 1
    batches = [e.step for e in second if isinstance(e, BatchAssembled)]
    assert batches == [3, 4]
    (stop2,) = [e for e in second if isinstance(e, RunStopped)]
    assert stop2.reason == "max_steps" and stop2.step == 4
    assert stop2.event_id == run_stopped_id("r", 1) != run_stopped_id("r")

    # A restarted orchestrator folds the log from the start, deciding under the config
    # in force (the role's ``config_in_force``): every decision is one already made.
    log = first + second
    assert {e.policy_version for e in log if isinstance(e, TaskRequested) and e.phase == "eval"} == {0, 2, 3, 4}  # fmt: skip
    ids = {e.event_id for e in log}

    def refold(config_of) -> list[str]:  # noqa: ANN001
        """What a fresh fold of ``log`` finds wrong: refused events, decisions not on it."""
        _, again = make()
        wrong = []
        for event in log:
            if (why := again.check(event)) is not None:
                wrong.append(why)
            again.apply(event)  # then decide under the config in force after it, as the role
            out = decide(again, config_of(again), cause=event.event_id)
            wrong += [f"new {type(e).__name__}" for e in out if e.event_id not in ids]
        assert again.stopped is not None and again.stopped.event_id == stop2.event_id
        return wrong

    assert refold(lambda s: old if s.segment == 0 else new) == []
    assert refold(lambda s: new) != []  # the newest config alone re-decides segment 0 otherwise


def test_only_the_orchestrators_own_next_segment_start_is_taken() -> None:
    cfg, state = make("max_steps=1")
    step(state, cfg, started(cfg))
    forged = msgspec.structs.replace(_resumed(cfg, 1), event_id="forged")
    assert "second run.started" in (state.check(forged) or "")
    skipping = _resumed(cfg, 2)  # segment 2 before segment 1
    assert "second run.started" in (state.check(skipping) or "")
    not_resumed = msgspec.structs.replace(_resumed(cfg, 1), resumed=False)
    assert "second run.started" in (state.check(not_resumed) or "")
    assert state.check(_resumed(cfg, 1)) is None
    # A stop with the first segment's id after a resume is not the orchestrator's.
    state.apply(_resumed(cfg, 1))
    old_stop = RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps")
    assert "not the orchestrator's" in (state.check(old_stop) or "")


# -- the launcher's monitor -----------------------------------------------------------------


def test_the_monitor_of_an_extended_run_waits_for_the_new_segments_stop() -> None:
    """The earlier segment's max_steps stop (below this launch's max_steps) does not stop
    the launcher, even if it is read before the orchestrator's resumed start; the resumed
    start is no forgery; the new segment's stop is the run's stop."""
    m = RunMonitor(run="r", max_steps=6)
    first = RunStarted(run="r", event_id="start", config={}, seed=0, model_path="m")
    m.apply(first)
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=4))
    assert m.stopped is None and m.rejected == 0
    m.apply(_resumed(RunConfig(max_steps=6), 1))
    assert m.segment == 1 and m.rejected == 0
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="user", step=5))
    assert m.stopped is None and m.rejected == 1  # segment 0's id: not the orchestrator's
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r", 1), reason="max_steps", step=6))
    assert m.stopped is not None and m.stopped.step == 6


def test_the_monitor_of_a_run_that_is_not_extended_stops_at_its_stop() -> None:
    m = RunMonitor(run="r", max_steps=4)
    m.apply(RunStarted(run="r", event_id="start", config={}, seed=0, model_path="m"))
    m.apply(RunStopped(run="r", event_id=run_stopped_id("r"), reason="max_steps", step=4))
    assert m.stopped is not None
    m.apply(msgspec.structs.replace(_resumed(RunConfig(), 1), event_id="forged"))
    assert m.rejected == 1 and m.stopped is not None
