"""Who may do what on a run's bus: one identity per role kind, each with its own
permissions, and the credentials files clients connect with.

Every run has one identity (a user and a random password) per role kind (``bus.kinds``):
every process of a kind presents the same one. An identity lives in one run and can
reach nothing of another: what it may publish and subscribe to names its run's subjects
and its run's three JetStream resources only (stream ``RL_<run>``, object store
``RLOBJ_<run>``, registry ``RLROLES_<run>``; ``bus.subjects``).

- **publish**: the topics its kind produces (``bus.kinds.KINDS``, the one place that
  says who produces what), inference requests (kinds that ask), objects (kinds
  that store bodies or weights), its roles' heartbeat keys, and the JetStream API
  subjects its reads, consumers and acks need, each naming one of its run's streams.
- **subscribe**: its own inbox prefix (``_INBOX_<run>_<kind>``, given to nats-py as
  ``inbox_prefix``: replies, consumer deliveries and acks all arrive there), so it
  cannot read other clients' replies; inference servers (kinds that answer) also
  ``rl.<run>.infer.*``, and may answer what they receive (``allow_responses``).
- ``reader`` (the read commands: status, events, lake, trace, replay) publishes nothing
  but read requests; ``launcher`` (``rlbus up``, rollout, import) is the admin of its run
  only: it creates, updates and deletes the run's streams, before any role starts.

    auth = RunAuth.ensure(paths.auth, run)      # made once, the same passwords afterwards
    auth.users()                                 # nats-server's authorization users
    auth.creds_file("env")                       # what an env process connects with

    python -m bus.auth                           # prints the permission table
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.kinds import KINDS, check_kind, kind_of_role, producers
from bus.subjects import (
    INFER,
    TOPICS,
    check_token,
    filter_subject,
    infer_patterns,
    objects_bucket,
    relative_subject,
    role_keys_pattern,
    roles_bucket_name,
    run_pattern,
    stream_name,
)

CREDS_ENV = "RLBUS_NATS_CREDS"  # a credentials file to connect with (``--creds``)
TLS_CA_ENV = "RLBUS_NATS_CA"  # the CA file that signs the servers' certificates (bus.tls_ca)


def user_name(run: str, kind: str) -> str:
    return f"{check_token(run, 'run id')}.{check_kind(kind)}"


def inbox_prefix(run: str, kind: str) -> str:
    """Where an identity's replies arrive: nats-py makes inboxes ``<prefix>.<nuid>``."""
    return f"_INBOX_{check_token(run, 'run id')}_{check_kind(kind)}"


def _names(run: str) -> tuple[str, str, str, str, str]:
    """(stream, object bucket, its stream, registry bucket, its stream): the JetStream
    streams behind an object store and a KV bucket are ``OBJ_<bucket>``, ``KV_<bucket>``."""
    obj, roles = objects_bucket(run), roles_bucket_name(run)
    return stream_name(run), obj, f"OBJ_{obj}", roles, f"KV_{roles}"


def _read_api(streams: tuple[str, ...], consumers: tuple[str, ...]) -> list[str]:
    """Reads of ``streams`` (info, message gets, direct gets) and ordered consumers on
    ``consumers`` (created unnamed, flow controlled; their info)."""
    out = []
    for s in streams:
        out += [f"$JS.API.STREAM.INFO.{s}", f"$JS.API.STREAM.MSG.GET.{s}"]
        out += [f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>"]
    for s in consumers:
        out += [f"$JS.API.CONSUMER.CREATE.{s}", f"$JS.API.CONSUMER.CREATE.{s}.>"]
        out += [f"$JS.API.CONSUMER.INFO.{s}.*", f"$JS.FC.{s}.>"]
    # nats-py looks a subscription's stream up by subject when not told (BodyStore.read,
    # ObjectStore.list): it answers with stream names only, never their contents.
    return [*out, "$JS.API.STREAM.NAMES"]


def _admin_api(streams: tuple[str, ...]) -> list[str]:
    """Everything on ``streams``: create, update, delete, purge, messages, consumers."""
    out = []
    for s in streams:
        out += [f"$JS.API.STREAM.*.{s}", f"$JS.API.STREAM.MSG.*.{s}"]
        out += [f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>"]
        out += [f"$JS.API.CONSUMER.*.{s}", f"$JS.API.CONSUMER.*.{s}.>"]
        out += [f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.>", f"$JS.API.CONSUMER.MSG.NEXT.{s}.>"]
        out += [f"$JS.ACK.{s}.>", f"$JS.FC.{s}.>"]
    return [*out, "$JS.API.STREAM.NAMES"]


def _topics(run: str, kind: str) -> list[str]:
    return [filter_subject(run, t) for t in TOPICS if kind in producers(t)]


def _permissions(run: str, kind: str) -> dict[str, Any]:
    stream, obj, obj_stream, roles, kv_stream = _names(run)
    inbox = f"{inbox_prefix(run, kind)}.>"
    if kind == "launcher":
        pub = [run_pattern(run), f"$O.{obj}.>", f"$KV.{roles}.>"]
        pub += _admin_api((stream, obj_stream, kv_stream))
        return {"publish": {"allow": pub}, "subscribe": {"allow": [inbox, run_pattern(run)]}}
    spec = KINDS[kind]
    pub = _topics(run, kind)
    if spec.infer == "asks":
        pub += infer_patterns(run)  # a model, or one replica
    if spec.objects:  # chunks and meta; replacing or deleting one purges its old chunks
        pub += [f"$O.{obj}.>", f"$JS.API.STREAM.PURGE.{obj_stream}"]
    pub += [f"$KV.{roles}.{role_keys_pattern(run, role)}" for role in spec.heartbeats]
    pub += _read_api((stream, obj_stream, kv_stream), (stream, obj_stream))
    if spec.durables:
        pub += [
            f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*",
            f"$JS.API.CONSUMER.DELETE.{stream}.*",
            f"$JS.API.CONSUMER.MSG.NEXT.{stream}.*",
            f"$JS.ACK.{stream}.>",
        ]
    sub = [inbox]
    perms: dict[str, Any] = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if spec.infer == "answers":
        sub += infer_patterns(run)
        perms["allow_responses"] = True
    return perms


def permissions(run: str, kind: str) -> dict[str, Any]:
    """The nats-server ``permissions`` object of ``kind``'s identity in ``run``."""
    return _permissions(check_token(run, "run id"), check_kind(kind))


def permission_rows() -> list[tuple[str, str, str]]:
    """(kind, may publish, may consume) of every kind, in words, for a table (topics
    relative to the run: ``trace.completed.*``)."""
    run = "r"  # any run: the rows name its subjects relative to it
    rows = []
    for kind in KINDS:
        if kind == "launcher":
            rows.append((kind, "the run's subjects, objects, registry", "everything of its run (admin)"))  # fmt: skip
            continue
        spec = KINDS[kind]
        pub = [relative_subject(run, t) for t in _topics(run, kind)]
        if spec.infer == "asks":
            pub.append(f"{INFER}.* (requests)")
        pub += ["objects"] if spec.objects else []
        pub += [f"heartbeats ({', '.join(spec.heartbeats)})"] if spec.heartbeats else []
        consume = ["reads the log, objects, registry"]
        consume += ["durable consumers"] if spec.durables else []
        consume += [f"answers {INFER}.*"] if spec.infer == "answers" else []
        rows.append((kind, ", ".join(pub) or "nothing", "; ".join(consume)))
    return rows


# -- credentials ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClientCreds:
    """What a client presents to the server: a user, its password, and the inbox prefix
    its replies arrive under (the only inboxes its identity may subscribe to)."""

    user: str
    password: str = field(repr=False)
    inbox_prefix: str


def load_creds(path: str | Path) -> ClientCreds:
    """Read a credentials file written by ``RunAuth`` (JSON, mode 0600)."""
    data = json.loads(Path(path).read_text())
    return ClientCreds(str(data["user"]), str(data["password"]), str(data["inbox_prefix"]))


def creds_from_env() -> ClientCreds | None:
    path = os.environ.get(CREDS_ENV)
    return load_creds(path) if path else None


def connect_options() -> dict[str, Any]:
    """nats.connect options from the environment: the identity of ``$RLBUS_NATS_CREDS``
    (``rlbus up`` gives each role its own) and TLS verified against ``$RLBUS_NATS_CA``.
    Empty: an anonymous plain connection. ``Bus.connect`` uses them."""
    out: dict[str, Any] = {}
    if (creds := creds_from_env()) is not None:
        out |= {"user": creds.user, "password": creds.password}
        out["inbox_prefix"] = creds.inbox_prefix
    if ca := os.environ.get(TLS_CA_ENV):
        out["tls"] = ssl.create_default_context(cafile=ca)
    return out


@contextlib.contextmanager
def env_set(values: dict[str, str]) -> Iterator[None]:
    """Within the block, the environment holds ``values`` (an identity, a CA) for this
    process's connections; afterwards it is as it was."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass(frozen=True)
class RunAuth:
    """The identities of one run, kept in ``directory`` (``runs/<run>/auth``, mode 0700):
    one credentials file per kind (``<kind>.creds``, JSON, mode 0600)."""

    directory: Path
    run: str
    _passwords: dict[str, str] = field(repr=False)

    @classmethod
    def ensure(cls, directory: str | Path, run: str) -> RunAuth:
        """The run's credentials: made for every kind missing, read back otherwise (a
        restarted server and the roles still running must agree on them)."""
        check_token(run, "run id")
        d = Path(directory)
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        d.chmod(0o700)
        passwords = {}
        for kind in KINDS:
            path = d / f"{kind}.creds"
            if not path.exists():
                _create(path, _creds_doc(run, kind, secrets.token_urlsafe(32)))
            data = json.loads(path.read_text())
            if (data.get("run"), data.get("kind")) != (run, kind):
                raise ValueError(f"{path} holds credentials of another run or kind")
            passwords[kind] = str(data["password"])
        return cls(d, run, passwords)

    def creds_file(self, kind: str) -> Path:
        """The credentials file of ``kind`` (a role name is taken as its kind)."""
        return self.directory / f"{kind_of_role(kind)}.creds"

    def creds(self, kind: str) -> ClientCreds:
        return load_creds(self.creds_file(kind))

    def users(self) -> list[dict[str, Any]]:
        """The run's entries of nats-server's ``authorization.users``."""
        return [
            {
                "user": user_name(self.run, kind),
                "password": self._passwords[kind],
                "permissions": permissions(self.run, kind),
            }
            for kind in KINDS
        ]


def _creds_doc(run: str, kind: str, password: str) -> dict[str, str]:
    return {
        "user": user_name(run, kind),
        "password": password,
        "inbox_prefix": inbox_prefix(run, kind),
        "run": run,
        "kind": kind,
    }


def _create(path: Path, doc: dict[str, str]) -> None:
    """Write ``path`` (mode 0600) unless it exists: written aside, then linked in, so a
    concurrent ``ensure`` never reads half a file and never replaces one."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        with contextlib.suppress(FileExistsError):  # made meanwhile: that one stands
            os.link(tmp, path)
    finally:
        tmp.unlink()


if __name__ == "__main__":
    for row in permission_rows():
        print(" | ".join(row))
