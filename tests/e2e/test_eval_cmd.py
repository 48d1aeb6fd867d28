"""`rlbus eval` end to end (embedded NATS, real inference and env role processes) and its
refusals; the eval of a run's checkpoint against that run's own eval of the version. That
a live run's orchestrator ignores its requests is tested in tests/unit/test_orchestrator.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import replay
from bus.reader import read_log
from bus.runtime import Bus
from bus.server import EmbeddedServer, running_server_url
from bus.subjects import Topic
from replay.sql import connect
from schemas import EvalCompleted, MetricsReported, TaskRequested, WeightsPublished, stable_seed
from schemas.arrays import i32, mask
from tests.e2e.conftest import ANALYTICS_RUN

REPO = Path(__file__).resolve().parents[2]


def rlbus_eval(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "roles.cli", "eval", *args, f"bus.data_dir={data_dir}"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=280, cwd=REPO)


async def eval_log(data_dir: Path, run: str) -> tuple[list[TaskRequested], list[EvalCompleted]]:
    """The run's eval requests and answers (reopening its stopped embedded server)."""
    with EmbeddedServer(data_dir / run / "nats") as server:
        bus = await Bus.connect(server.url, run=run, producer="e2e")
        try:
            topics = [(Topic.TASK_REQUESTED, None), (Topic.EVAL_COMPLETED, None)]
            events = [e async for e in read_log(bus, topics, (TaskRequested, EvalCompleted))]
        finally:
            await bus.close()
    requests = [e for e in events if isinstance(e, TaskRequested)]
    return requests, [e for e in events if isinstance(e, EvalCompleted)]


def completions(answers: list[EvalCompleted]) -> dict[tuple[int, int], list[list[int]]]:
    """(task, sample) -> the sampled token ids of each of its turns."""
    return {
        (a.task_index, t.sample_index): [
            i32(m.token_ids)[mask(m.sampled)].tolist() for m in t.messages if m.sampled
        ]
        for a in answers
        for t in a.traces
    }


def processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes (but this one) that contain ``text``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        if text in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.e2e
async def test_eval_command_scores_each_env_like_the_runs_eval(tmp_path: Path) -> None:
    """`rlbus eval --env reverse-text --env alphabet-sort -n 3 -k 2 --json` starts inference
    and one env server per env, asks k samples of eval tasks 0..2 with the config's eval
    sampling and the orchestrator's eval seeds, prints avg@k/pass@k per env that agree
    with the answers on the log, and leaves no process behind."""
    args = ["--run", "ev1", "--env", "reverse-text", "--env", "alphabet-sort", "-n", "3", "-k", "2", "--json"]  # fmt: skip
    proc = await asyncio.to_thread(
        rlbus_eval, tmp_path, *args, "orchestrator.eval.sampling.temperature=1.0"
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    report = json.loads(proc.stdout)
    assert report["run"] == "ev1" and report["model"] == "policy" and report["k"] == 2
    assert report["temperature"] == 1.0 and report["policy_versions"] == [0]
    assert report["rollouts"] == 12 and list(report["envs"]) == ["reverse-text", "alphabet-sort"]
    assert "eval: 12/12 rollouts (100%)" in proc.stderr  # progress, on stderr
    for name in ("inference-policy", "env-reverse-text", "env-alphabet-sort"):
        assert f"stopped {name} (exit 0)" in proc.stderr  # drained on SIGTERM, not killed
    assert running_server_url(tmp_path / "ev1" / "nats") is None
    assert processes_mentioning(str(tmp_path)) == []

    requests, answers = await eval_log(tmp_path, "ev1")
    assert len(requests) == 6 and len(answers) == 6
    for r in requests:
        assert r.task.split == "eval" and r.group_size == 2 and r.phase == "adhoc"
        assert r.sampling.temperature == 1.0 and r.sampling.max_completion_tokens == 16
        assert r.seed == stable_seed(0, "eval", r.env, r.task.index)
    for env, scores in report["envs"].items():
        mine = sorted((a for a in answers if a.env == env), key=lambda a: a.task_index)
        assert [a.task_index for a in mine] == [0, 1, 2] and scores["tasks"] == 3
        assert all(len(a.rewards) == 2 for a in mine)
        avg = sum(sum(a.rewards) / 2 for a in mine) / 3
        assert 0.0 <= scores["avg@2"] <= 1.0 and scores["avg@2"] == pytest.approx(avg)
        assert scores["errors"] == sum(a.errors for a in mine) == 0
        if all(x in (0.0, 1.0) for a in mine for x in a.rewards):
            passed = sum(1.0 for a in mine if 1.0 in a.rewards) / 3
            assert scores["pass@2"] == pytest.approx(passed) and scores["pass@2"] >= scores["avg@2"]
        else:  # pass@k is defined for 0/1 rewards only, as in a run's eval
            assert scores["pass@2"] is None


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--env", "nope"], "env error: unknown env 'nope'"),
        (["-k", "0"], "error: -n and -k must be >= 1"),
        (["--model", "nobody"], "error: --model 'nobody' is neither policy"),
        (["--checkpoint", "gone:3"], "error: --checkpoint 'gone:3': no checkpoint under"),
        (["--checkpoint", "x", "-m", "teacher"], "error: --model and --checkpoint both"),
        (["--model", "."], "error: --model .: a directory with neither config.json"),
    ],
)
def test_eval_refuses_bad_envs_and_options_in_one_line(
    tmp_path: Path, args: list[str], message: str
) -> None:
    """An unknown env, a bad -k, an unknown model: exit 2, one line, nothing started."""
    proc = rlbus_eval(tmp_path, "--run", "bad", *args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1
    assert not (tmp_path / "bad").exists()


@pytest.mark.e2e
async def test_eval_of_a_checkpoint_reproduces_the_runs_eval_of_that_version(
    tmp_path: Path, smoke: tuple[Path, list[Any]]
) -> None:
    """`rlbus eval -m <run>/checkpoints/step-4` (the smoke run's final checkpoint, v4)
    serves those weights in a run of its own with the source run's eval settings: the same
    tasks, seeds and sampling as the run's eval of v4, avg@k within 3 standard errors of
    it, the same completions (greedy: v4's, where v0's would be other tokens; at most one
    of four may differ by a near-tie under another batching), every rollout answered by
    the pinned version. The report is written, and the eval run's lake holds its rollouts
    and figures."""
    data, events = smoke
    ckpt = data / ANALYTICS_RUN / "checkpoints" / "step-00000004"
    v4 = next(e for e in events if isinstance(e, WeightsPublished) and e.version == 4)
    assert json.loads((ckpt / "state.json").read_text())["weights_digest"] == v4.weights.digest
    proc = await asyncio.to_thread(rlbus_eval, tmp_path, "-m", str(ckpt), "--run", "evck")
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-2000:]
    report_file = next((tmp_path / "evck").glob("eval-*.json"))
    report = json.loads(report_file.read_text())
    assert report["checkpoint"] == {"run": ANALYTICS_RUN, "step": 4, "path": str(ckpt)}
    assert report["pinned_version"] == 0 and report["policy_versions"] == [0]
    assert "(step 4 of run ana1, served as v0)" in proc.stdout and "avg@1 ± stderr" in proc.stdout

    ours = report["envs"]["reverse-text"]
    theirs = next(e for e in events if isinstance(e, MetricsReported) and e.role == "eval" and e.step == 4).values  # fmt: skip
    noise = max(ours["avg@1_stderr"], theirs["reverse-text/avg@1_stderr"], 1e-3)
    assert abs(ours["avg@1"] - theirs["reverse-text/avg@1"]) <= 3 * noise, (ours, theirs)
    assert ours["tasks"] == 4 and ours["answered_by_pinned"] == 1.0 and ours["errors"] == 0

    requests, answers = await eval_log(tmp_path, "evck")
    in_run = [e for e in events if isinstance(e, TaskRequested) and e.phase == "eval" and e.policy_version == 4]  # fmt: skip
    asked = lambda rs: sorted((r.task.index, r.seed, r.group_size, r.sampling) for r in rs)  # noqa: E731
    assert asked(requests) == asked(in_run)
    ids = {r.event_id for r in in_run}
    theirs_done = [e for e in events if isinstance(e, EvalCompleted) and e.request_id in ids]
    mine, same = completions(answers), completions(theirs_done)
    assert mine.keys() == same.keys() and len(mine) == 4
    assert sum(mine[key] == same[key] for key in mine) >= 3, (mine, same)

    result = await asyncio.to_thread(replay.sync_lake, "evck", tmp_path, None, True)
    assert result is not None
    con = connect(tmp_path, "evck")
    assert con.sql("select count(*) from rollouts where split = 'eval'").fetchall() == [(4,)]
    [(avg,)] = con.sql("select value from metrics where role = 'eval-adhoc' and metric = 'reverse-text/avg@1'").fetchall()  # fmt: skip
    assert avg == pytest.approx(ours["avg@1"])


def answered(journal: Path) -> list[dict[str, Any]]:
    """The answers an eval journal holds so far (a torn last line left out)."""
    out = []
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            break
        if "answered" in record:
            out.append(record["answered"])
    return out


@pytest.mark.e2e
@pytest.mark.slow  # three evals, each starting its roles: about 2 minutes here
async def test_an_eval_killed_part_way_resumes_without_repeating_a_task(tmp_path: Path) -> None:
    """`rlbus eval` SIGKILLed after some of its 12 tasks were answered (it and every
    process it started die) leaves each answer in its journal (`<run>/eval.tasks.jsonl`);
    `--resume` asks only the rest, under their first request ids, so each task is asked
    and answered once on the run's log; its report is the one an uninterrupted eval with
    the same settings gives (wall time aside). A resume with another -k is refused in one
    line naming `k`, and changes nothing."""
    # One group at a time per env, each batch held 300 ms: the kill lands mid-eval.
    slow = ["inference.batch_window_ms=300", "env_server.groups_in_flight=1"]
    base = ["--env", "reverse-text", "--env", "alphabet-sort", "-n", "6", *slow]
    args = [*base, "-k", "2"]
    cmd = [sys.executable, "-m", "roles.cli", "eval", "--run", "evk", *args]
    proc = subprocess.Popen(  # noqa: ASYNC220 - polled below, never waited on blocking
        [*cmd, f"bus.data_dir={tmp_path}"], cwd=REPO, text=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    journal = tmp_path / "evk" / "eval.tasks.jsonl"
    try:
        for _ in range(2400):  # up to 120 s for roles to start and answers to come
            if len(answered(journal)) >= 2 or proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        proc.kill()
        _, err = await asyncio.to_thread(proc.communicate, timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    before = answered(journal)
    assert 2 <= len(before) < 12, err[-3000:]
    for _ in range(100):  # its children die with it (parent-death signal)
        if not processes_mentioning(str(tmp_path)):
            break
        await asyncio.sleep(0.1)
    assert processes_mentioning(str(tmp_path)) == []

    refused = await asyncio.to_thread(rlbus_eval, tmp_path, "--run", "evk", "--resume", *base, "-k", "1")  # fmt: skip
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith("error: --resume: k differs from the interrupted eval's")
    assert answered(journal) == before

    resumed = await asyncio.to_thread(rlbus_eval, tmp_path, "--run", "evk", "--resume", "--json", *args)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming: {len(before)} task(s) answered" in resumed.stderr
    whole = await asyncio.to_thread(rlbus_eval, tmp_path, "--run", "evw", "--json", *args)
    assert whole.returncode == 0, whole.stderr[-4000:]
    ours, theirs = json.loads(resumed.stdout), json.loads(whole.stdout)
    for report in (ours, theirs):
        report.pop("wall_s"), report.pop("run")
    assert ours == theirs and ours["rollouts"] == 24

    after = answered(journal)
    assert after[: len(before)] == before  # kept, not asked again
    tasks = [(a["env"], a["task_index"]) for a in after]
    assert len(tasks) == len(set(tasks)) == 12
    requests, answers = await eval_log(tmp_path, "evk")
    asked = [(r.env, r.task.index) for r in requests]
    assert len(asked) == len(set(asked)) == 12  # each task asked once on the log
    assert sorted(a.request_id for a in answers) == sorted(r.event_id for r in requests)
