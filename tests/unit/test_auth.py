"""The identities of a run: permissions derived from the role registry, isolated per run,
and credentials files made once and kept private. (The server enforcing them:
tests/integration/test_auth.py.)"""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest

from bus import auth
from bus.auth import RunAuth, load_creds, permission_rows, permissions
from bus.kinds import KINDS, ROLES, kind_of_role, kinds_that, producers
from bus.subjects import TOPICS, Topic, filter_subject, kind_of_bucket, objects_bucket

INFER_REQUESTERS, INFER_SERVERS = kinds_that("asks"), kinds_that("answers")


def matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` one token, ``>`` one or more trailing tokens."""
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def may_publish(run: str, kind: str, subject: str, durables: auth.Durables | None = None) -> bool:
    """What nats-server decides: allowed by a pattern and denied by none."""
    publish = permissions(run, kind, durables)["publish"]
    allowed = any(matches(p, subject) for p in publish["allow"])
    return allowed and not any(matches(p, subject) for p in publish.get("deny", []))


def may_subscribe(run: str, kind: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(run, kind)["subscribe"]["allow"])


def topic_subject(run: str, topic: Topic) -> str:
    return filter_subject(run, topic).replace("*", "x")


def run_resources(run: str) -> list[str]:
    """Subjects that read or write ``run``'s data: its topics, inference, objects,
    registry, the JetStream API on its three streams, acks and inboxes."""
    out = [topic_subject(run, t) for t in Topic] + [f"rl.{run}.infer.policy"]
    out += [f"$KV.RLROLES_{run}.{run}.env.e0"]
    for b in auth.run_buckets(run):
        out += [f"$O.{b}.C.abc", f"$O.{b}.M.abc"]
    for s in (f"RL_{run}", *(f"OBJ_{b}" for b in auth.run_buckets(run)), f"KV_RLROLES_{run}"):
        for op in ("STREAM.INFO", "STREAM.CREATE", "STREAM.PURGE", "STREAM.DELETE",
                   "STREAM.MSG.GET", "DIRECT.GET", "CONSUMER.CREATE"):  # fmt: skip
            out.append(f"$JS.API.{op}.{s}")
        out += [f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.d", f"$JS.API.CONSUMER.INFO.{s}.d"]
        out += [f"$JS.API.CONSUMER.MSG.NEXT.{s}.d", f"$JS.ACK.{s}.d.1.1.1.1.1", f"$JS.FC.{s}.c.1"]
    return out + [f"_INBOX_{run}_env.abc.1", "_INBOX.abc"]


def test_every_topic_has_a_producer_and_every_role_an_identity() -> None:
    for t in TOPICS:
        assert producers(t), t
    assert set(INFER_REQUESTERS) == {"env", "algorithm", "attach", "gateway"}
    assert set(INFER_SERVERS) == {"inference", "teacher"}
    assert {r.kind for r in ROLES.values()} <= set(KINDS)
    assert kind_of_role("lake") == "monitor" and kind_of_role("attach") == "attach"


@pytest.mark.parametrize("kind", [k for k in KINDS if k != "launcher"])
def test_a_kind_publishes_exactly_the_topics_it_produces(kind: str) -> None:
    for t in TOPICS:
        if t == Topic.DEAD_LETTERED:  # under its own role names only (the matrix below)
            continue
        assert may_publish("r1", kind, topic_subject("r1", t)) == (kind in producers(t)), t
    assert may_publish("r1", kind, "rl.r1.infer.policy") == (kind in INFER_REQUESTERS)


def test_env_may_publish_traces_not_batches_or_weights() -> None:
    assert may_publish("r1", "env", "rl.r1.trace.completed.reverse-text")
    assert may_publish("r1", "env", "rl.r1.eval.completed.reverse-text")
    assert not may_publish("r1", "env", "rl.r1.batch.assembled")
    assert not may_publish("r1", "env", "rl.r1.weights.published")
    assert not may_publish("r1", "env", "rl.r1.run.stopped")


def test_reader_writes_nothing() -> None:
    """No run subject, object, registry key, consumer position or stream change; reads."""
    reads = ("$JS.API.STREAM.INFO.", "$JS.API.STREAM.MSG.GET.", "$JS.API.DIRECT.GET.",
             "$JS.API.CONSUMER.CREATE.RL_", "$JS.API.CONSUMER.CREATE.OBJ_",
             "$JS.API.CONSUMER.INFO.", "$JS.FC.RL_", "$JS.FC.OBJ_")  # fmt: skip
    for subject in run_resources("r1"):
        if not subject.startswith(reads) and not subject.startswith("_INBOX_r1_reader."):
            assert not may_publish("r1", "reader", subject), subject
    for subject in ("$JS.API.STREAM.INFO.RL_r1", "$JS.API.CONSUMER.CREATE.RL_r1",
                    "$JS.API.STREAM.MSG.GET.KV_RLROLES_r1", "$JS.API.STREAM.INFO.OBJ_RLOBJ_r1"):  # fmt: skip
        assert may_publish("r1", "reader", subject), subject
    assert not may_publish("r1", "reader", "rl.r1.anything.else")


def test_only_the_launcher_changes_streams() -> None:
    for kind in KINDS:
        for s in ("RL_r1", "OBJ_RLOBJ_r1", "KV_RLROLES_r1"):
            for op in ("CREATE", "UPDATE", "DELETE"):
                assert may_publish("r1", kind, f"$JS.API.STREAM.{op}.{s}") == (kind == "launcher")
    # purging its own object store comes with storing objects (a replaced object's chunks)
    assert may_publish("r1", "trainer", "$JS.API.STREAM.PURGE.OBJ_RLOBJTRAINER_r1")
    assert not may_publish("r1", "trainer", "$JS.API.STREAM.PURGE.OBJ_RLOBJ_r1")
    assert not may_publish("r1", "trainer", "$JS.API.STREAM.PURGE.RL_r1")
    assert not may_publish("r1", "reader", "$JS.API.STREAM.PURGE.OBJ_RLOBJTRAINER_r1")


# The permission matrix of a run whose config declares its durables: for each action a
# faulty role could take against another, the kinds that may (the launcher: every one).
DECLARED = {"trainer": ["trainer"], "env": ["env-rt"], "algorithm": ["algorithm-grpo"]}
ACTIONS = {
    "dead-letter as the env server": "rl.r1.dead.lettered.env",
    "dead-letter as the trainer": "rl.r1.dead.lettered.trainer",
    "dead-letter as the lake": "rl.r1.dead.lettered.lake",
    "dead-letter as an algorithm worker": "rl.r1.dead.lettered.algorithm",
    "write weights (the trainer's objects)": "$O.RLOBJTRAINER_r1.M.d2VpZ2h0cy52MA",
    "purge the trainer's objects": "$JS.API.STREAM.PURGE.OBJ_RLOBJTRAINER_r1",
    "write the env's objects (bodies)": "$O.RLOBJENV_r1.C.abc",
    "purge the env's objects": "$JS.API.STREAM.PURGE.OBJ_RLOBJENV_r1",
    "write the shared objects (anonymous runs)": "$O.RLOBJ_r1.M.abc",
    "create the trainer's durable": "$JS.API.CONSUMER.DURABLE.CREATE.RL_r1.trainer",
    "create it by name (new API)": "$JS.API.CONSUMER.CREATE.RL_r1.trainer.rl.r1.batch.assembled",
    "pull the trainer's batches": "$JS.API.CONSUMER.MSG.NEXT.RL_r1.trainer",
    "ack the trainer's batches": "$JS.ACK.RL_r1.trainer.1.7.7.1.0",
    "delete the trainer's durable": "$JS.API.CONSUMER.DELETE.RL_r1.trainer",
    "pull the env's tasks": "$JS.API.CONSUMER.MSG.NEXT.RL_r1.env-rt",
    "delete the env's durable": "$JS.API.CONSUMER.DELETE.RL_r1.env-rt",
    "pull a config algorithm's traces": "$JS.API.CONSUMER.MSG.NEXT.RL_r1.algorithm-grpo",
    "make a durable of a new name": "$JS.API.CONSUMER.DURABLE.CREATE.RL_r1.algorithm-new",
}
MAY = {
    "dead-letter as the env server": {"env"},
    "dead-letter as the trainer": {"trainer"},
    "dead-letter as the lake": {"monitor"},
    "dead-letter as an algorithm worker": {"algorithm", "attach"},
    "write weights (the trainer's objects)": {"trainer"},
    "purge the trainer's objects": {"trainer"},
    "write the env's objects (bodies)": {"env"},
    "purge the env's objects": {"env"},
    "write the shared objects (anonymous runs)": set(),
    "create the trainer's durable": {"trainer"},
    "create it by name (new API)": {"trainer"},
    "pull the trainer's batches": {"trainer"},
    "ack the trainer's batches": {"trainer"},
    "delete the trainer's durable": {"trainer"},
    "pull the env's tasks": {"env"},
    "delete the env's durable": {"env"},
    "pull a config algorithm's traces": {"algorithm", "attach"},
    "make a durable of a new name": {"attach"},
}


@pytest.mark.parametrize("action", list(ACTIONS))
def test_the_permission_matrix(action: str) -> None:
    """Every cell: each identity may take the action exactly when its role needs it."""
    subject = ACTIONS[action]
    allowed = {k for k in KINDS if may_publish("r1", k, subject, DECLARED)}
    assert allowed == MAY[action] | {"launcher"}, action


def test_without_declared_durables_durable_kinds_use_any_name() -> None:
    """A server made without a run's config (a test's, ``rlbus nats serve``): any name."""
    for kind in KINDS:
        may = may_publish("r1", kind, "$JS.API.CONSUMER.MSG.NEXT.RL_r1.trainer")
        assert may == (KINDS[kind].durables or kind == "launcher"), kind


def test_declared_durables_are_kept_with_the_credentials(tmp_path: Path) -> None:
    first = RunAuth.ensure(tmp_path / "auth", "r1")
    assert first.durables is None
    declared = first.declare(DECLARED)
    again = RunAuth.ensure(tmp_path / "auth", "r1")  # a restarted server reads them back
    assert again.durables == declared.durables == DECLARED
    assert again.users() == declared.users() != first.users()
    with pytest.raises(ValueError, match="durable name"):
        first.declare({"env": ["env.x"]})


def test_the_launchers_credentials_live_apart(tmp_path: Path) -> None:
    """Outside the run directory, under the data directory's ``.admin`` (a role's sandbox
    hides all of it); a run laid out before moves its file there."""
    old = tmp_path / "runs" / "r1" / "auth-admin"
    old.mkdir(parents=True)
    doc = {"run": "r1", "kind": "launcher", "password": "p", "user": "u", "inbox_prefix": "i"}
    (old / "launcher.creds").write_text(json.dumps(doc))
    a = RunAuth.ensure(tmp_path / "runs" / "r1" / "auth", "r1")
    launcher = a.creds_file("launcher")
    assert launcher.parent == tmp_path / "runs" / ".admin" / "r1" and launcher.exists()
    assert a.creds("launcher").password == "p" and not (old / "launcher.creds").exists()
    assert stat.S_IMODE(launcher.parent.stat().st_mode) == 0o700
    assert {p.name for p in (tmp_path / "runs" / "r1" / "auth").iterdir()} == {
        f"{k}.creds" for k in KINDS if k != "launcher"
    }
    # elsewhere (``rlbus nats config --out deploy``): beside the directory
    assert RunAuth.ensure(tmp_path / "deploy" / "r1", "r1").creds_file("launcher").parent == (
        tmp_path / "deploy" / "r1-admin"
    )
    # a run made before: its launcher file is moved, the same password kept
    old = tmp_path / "old"
    b = RunAuth.ensure(old / "auth", "r2")
    password = b.creds("launcher").password
    b.creds_file("launcher").rename(old / "auth" / "launcher.creds")
    assert RunAuth.ensure(old / "auth", "r2").creds("launcher").password == password
    assert not (old / "auth" / "launcher.creds").exists()


def test_each_kind_has_its_own_object_store_named_apart() -> None:
    """No run id makes one kind's store another's (kinds hold no ``_``)."""
    names = {objects_bucket(run, k) for run in ("a", "a_env", "env_a", "ENV_a") for k in KINDS}
    names |= {objects_bucket(run) for run in ("a", "a_env", "env_a", "ENV_a")}
    assert len(names) == 4 * (len(KINDS) + 1)
    assert kind_of_bucket("a_env", objects_bucket("a_env", "trainer")) == "trainer"
    assert kind_of_bucket("a", objects_bucket("a")) is None
    with pytest.raises(ValueError):
        kind_of_bucket("a", objects_bucket("a_env", "trainer"))


@pytest.mark.parametrize("kind", list(KINDS))
def test_no_identity_reaches_another_run(kind: str) -> None:
    """Run ids that share a prefix included: a subject token matches whole."""
    for mine, other in (("a", "ab"), ("ab", "a"), ("a", "a_b"), ("a_env", "a")):
        for subject in run_resources(other):
            assert not may_publish(mine, kind, subject), (mine, kind, subject)
            assert not may_subscribe(mine, kind, subject), (mine, kind, subject)


@pytest.mark.parametrize("kind", list(KINDS))
def test_subscriptions_are_the_own_inbox_and_served_requests(kind: str) -> None:
    perms = permissions("r1", kind)
    subs = perms["subscribe"]["allow"]
    assert subs[0] == auth.inbox_prefix("r1", kind) + ".>"
    assert may_subscribe("r1", kind, "rl.r1.infer.policy") == (
        kind in INFER_SERVERS or kind == "launcher"
    )
    assert not may_subscribe("r1", kind, "_INBOX.abc")
    assert perms.get("allow_responses", False) == (kind in INFER_SERVERS)
    # signs of life and replies go into the askers' inboxes, and nobody else's
    for asker in KINDS:
        into = f"{auth.inbox_prefix('r1', asker)}.abc"
        assert may_publish("r1", kind, into) == (
            kind in INFER_SERVERS and asker in INFER_REQUESTERS
        )


def test_heartbeats_only_under_the_kinds_own_role_names() -> None:
    assert may_publish("r1", "env", "$KV.RLROLES_r1.r1.env.env-x-host-1")
    assert not may_publish("r1", "env", "$KV.RLROLES_r1.r1.trainer.t0")
    assert may_publish("r1", "attach", "$KV.RLROLES_r1.r1.algorithm.a0")
    assert may_publish("r1", "monitor", "$KV.RLROLES_r1.r1.lake.l0")
    assert not may_publish("r1", "reader", "$KV.RLROLES_r1.r1.reader.r0")


def test_every_role_command_has_a_kind() -> None:
    from roles.cli.role import app

    names = [c.name or "" for c in app.registered_commands]
    assert names and all(kind_of_role(n) in KINDS for n in names)
    assert kind_of_role("lake") == "monitor" and kind_of_role("reader") == "reader"
    with pytest.raises(ValueError):
        kind_of_role("nobody")


def test_permission_rows_cover_every_kind() -> None:
    rows = permission_rows()
    assert [r[0] for r in rows] == list(KINDS)
    assert dict((k, p) for k, p, _ in rows)["reader"] == "nothing"
    assert "trace.completed.*" in dict((k, p) for k, p, _ in rows)["env"]


def test_credentials_are_private_and_stable(tmp_path: Path) -> None:
    directory = tmp_path / "r1" / "auth"
    first = RunAuth.ensure(directory, "r1")
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for kind in KINDS:
        path = first.creds_file(kind)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        creds = load_creds(path)
        assert creds.user == auth.user_name("r1", kind)
        assert creds.inbox_prefix == auth.inbox_prefix("r1", kind)
        assert creds.password not in repr(creds)
    again = RunAuth.ensure(directory, "r1")
    assert again.users() == first.users()
    passwords = [u["password"] for u in first.users()]
    assert len(set(passwords)) == len(KINDS) and all(len(p) >= 32 for p in passwords)
    assert not any(p in repr(first) for p in passwords)
    other = RunAuth.ensure(tmp_path / "r2" / "auth", "r2")
    assert not set(passwords) & {u["password"] for u in other.users()}
    assert first.creds_file("lake") == first.creds_file("monitor")
    with pytest.raises(ValueError):
        RunAuth.ensure(directory, "r2")  # another run's directory


def test_users_are_nats_server_entries(tmp_path: Path) -> None:
    users = RunAuth.ensure(tmp_path, "r1").users()
    json.dumps(users)  # the server's config is JSON
    assert [u["user"] for u in users] == [auth.user_name("r1", k) for k in KINDS]
    for u in users:
        assert set(u) == {"user", "password", "permissions"}
        assert set(u["permissions"]) <= {"publish", "subscribe", "allow_responses"}


def test_every_role_of_the_registry_has_its_rlbus_role_command_and_entry() -> None:
    """``rlbus role <name>`` exists exactly for the registry's roles, and each entry names
    a function of a module that exists (not imported here: torch)."""
    import importlib.util

    from roles.cli.role import app

    assert {c.name for c in app.registered_commands} == set(ROLES)
    for role in ROLES.values():
        module, func = role.entry.split(":")
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin is not None, role
        assert re.search(rf"async def {func}\(\s*ctx", Path(spec.origin).read_text()), role
