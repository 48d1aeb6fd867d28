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
from bus.subjects import TOPICS, Topic, filter_subject

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


def may_publish(run: str, kind: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(run, kind)["publish"]["allow"])


def may_subscribe(run: str, kind: str, subject: str) -> bool:
    return any(matches(p, subject) for p in permissions(run, kind)["subscribe"]["allow"])


def topic_subject(run: str, topic: Topic) -> str:
    return filter_subject(run, topic).replace("*", "x")


def run_resources(run: str) -> list[str]:
    """Subjects that read or write ``run``'s data: its topics, inference, objects,
    registry, the JetStream API on its three streams, acks and inboxes."""
    out = [topic_subject(run, t) for t in Topic] + [f"rl.{run}.infer.policy"]
    out += [f"$O.RLOBJ_{run}.C.abc", f"$O.RLOBJ_{run}.M.abc", f"$KV.RLROLES_{run}.{run}.env.e0"]
    for s in (f"RL_{run}", f"OBJ_RLOBJ_{run}", f"KV_RLROLES_{run}"):
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
    # purging the object stream comes with storing objects (a replaced object's chunks)
    assert may_publish("r1", "trainer", "$JS.API.STREAM.PURGE.OBJ_RLOBJ_r1")
    assert not may_publish("r1", "trainer", "$JS.API.STREAM.PURGE.RL_r1")
    assert not may_publish("r1", "reader", "$JS.API.STREAM.PURGE.OBJ_RLOBJ_r1")


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
