"""The eval journal (`roles.up.eval_journal`): what `rlbus eval --resume` continues from."""

from __future__ import annotations

from pathlib import Path

import pytest

from configs import load_config
from roles.up.eval_journal import EvalJournal, JournalMismatch, eval_settings
from roles.up.rollout import build_requests, plan_requests
from schemas import EvalCompleted, derive_id
from tests.samples import trace


def plans(*overrides: str, k: int = 2):  # noqa: ANN201
    cfg = load_config("smoke", list(overrides))
    return [plan_requests(cfg, env, "eval", 3 * k, k, "policy") for env in ("reverse-text", "alphabet-sort")]  # fmt: skip


def asked(ps) -> list:  # noqa: ANN001
    return [r for p in ps for r in build_requests("r", 0, p, 3)]


def answer(request, reward: float = 1.0) -> EvalCompleted:  # noqa: ANN001
    return EvalCompleted(
        run="r", request_id=request.event_id, env=request.env, step=0,
        task_index=request.task.index, rewards=[reward], traces=[trace()],
    )  # fmt: skip


def test_a_resume_asks_only_unanswered_tasks_under_their_first_ids(tmp_path: Path) -> None:
    """Answers survive on disk (a torn last line is ignored); a resume gets back each one,
    asks the other tasks again with the ids and seeds first given them, reads answers
    from where the log ended the first time, and a finished journal asks nothing."""
    path = tmp_path / "eval.tasks.jsonl"
    ps = plans()
    settings = eval_settings(ps, 2, "policy")
    first = EvalJournal.start(path, settings)
    requests = asked(ps)
    todo, from_seq = first.ask(requests, version=0, last_seq=41)
    assert (todo, from_seq) == (requests, 41)
    for r in requests[:4]:
        first.answered(answer(r))
    first.answered(answer(requests[0], reward=0.0))  # a second answer to a task: not kept
    with path.open("a") as f:
        f.write('{"answered": {"type": "eval_co')  # killed mid-write

    again = EvalJournal.resume(path, settings)
    assert [a.rewards for a in again.answers.values()] == [[1.0]] * 4
    assert again.answers["reverse-text/0"].traces == [trace()]  # traces round trip
    fresh = asked(ps)  # a new process draws new ids ...
    todo, from_seq = again.ask(fresh, version=0, last_seq=99)
    assert from_seq == 41  # ... but reads the answers the first one may have missed
    assert [r.event_id for r in todo] == [r.event_id for r in requests[4:]]
    assert [r.group_id for r in todo] == [derive_id(r.event_id, "group") for r in requests[4:]]
    assert [r.seed for r in todo] == [r.seed for r in requests[4:]]
    for r in todo:
        again.answered(answer(r))
    done = EvalJournal.resume(path, settings)
    assert done.ask(asked(ps), version=0, last_seq=120) == ([], 41)


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (lambda: eval_settings(plans(), 1, "policy"), "k differs"),
        (lambda: eval_settings(plans(), 2, "teacher"), "model differs"),
        (lambda: eval_settings(plans()[:1], 2, "policy"), "envs differs"),
        (
            lambda: eval_settings(plans("orchestrator.eval.sampling.temperature=0.5"), 2, "policy"),
            "env.reverse-text.sampling.temperature differs from the interrupted eval's (0.5 here, 0.0 there",
        ),
        (
            lambda: eval_settings(plans('orchestrator.eval.env=[{id="reverse-text"}, {id="alphabet-sort", args={min_names=3}}]'), 2, "policy"),
            "env.alphabet-sort.args.min_names differs",
        ),
    ],
)  # fmt: skip
def test_a_resume_with_other_settings_is_refused_naming_the_setting(
    tmp_path: Path, other, named: str
) -> None:
    """k, the model, the envs, an env's sampling or args: each differing one is named."""
    path = tmp_path / "eval.tasks.jsonl"
    EvalJournal.start(path, eval_settings(plans(), 2, "policy"))
    with pytest.raises(JournalMismatch, match=named.replace("(", r"\(").replace(".", r"\.")):
        EvalJournal.resume(path, other())


def test_a_resume_after_the_run_trained_or_without_a_journal_is_refused(tmp_path: Path) -> None:
    """Answers of one weights version only; no journal, nothing to resume."""
    path = tmp_path / "eval.tasks.jsonl"
    settings = eval_settings(plans(), 2, "policy")
    EvalJournal.start(path, settings).ask(asked(plans()), version=3, last_seq=7)
    with pytest.raises(JournalMismatch, match=r"weights version differs .*\(v4 here, v3 there"):
        EvalJournal.resume(path, settings).ask(asked(plans()), version=4, last_seq=9)
    with pytest.raises(JournalMismatch, match="no interrupted eval to resume"):
        EvalJournal.resume(tmp_path / "none.jsonl", settings)
