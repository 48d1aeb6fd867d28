"""Who may do what on a run's bus: one identity per role kind, each with its own
permissions, and the credentials files clients connect with.

Every run has one identity (a user and a random password) per role kind (``bus.kinds``):
every process of a kind presents the same one. An identity lives in one run and can
reach nothing of another: what it may publish and subscribe to names its run's subjects
and its run's JetStream resources only (stream ``RL_<run>``, object stores
``RLOBJ<KIND>_<run>``, registry ``RLROLES_<run>``; ``bus.subjects``). Within its run it
may do what its role needs and no more (least privilege):

- **publish**: the topics its kind produces (``bus.kinds.KINDS``, the one place that
  says who produces what), dead letters under its own role names only
  (``dead.lettered.<role>``), inference requests (kinds that ask), objects in its own
  object store only (weights are written by the trainer alone; a kind purges nothing but
  its own store's chunks), its roles' heartbeat keys, and the JetStream API subjects its
  reads need, each naming one of its run's streams.
- **durable consumers**: the names its role owns, from the run's config (``declare``:
  the trainer's, the env servers', the algorithm workers'), created, fetched, acked and
  deleted by it alone; every other kind is denied them, reads included. ``attach``
  names its workers at run time: any name but the other kinds'. A run that declared none
  (a test's server) lets every durable kind use any name.
- **subscribe**: its own inbox prefix (``_INBOX_<run>_<kind>``, given to nats-py as
  ``inbox_prefix``: replies, consumer deliveries and acks all arrive there), so it
  cannot read other clients' replies; inference servers (kinds that answer) also
  ``rl.<run>.infer.*``, and may answer what they receive (``allow_responses``), signs
  of life included: they publish into the asking kinds' inboxes (``bus.rpc``).
- ``reader`` (the read commands: status, events, lake, trace, replay) publishes nothing
  but read requests; ``launcher`` (``rlbus up``, rollout, import) is the admin of its run
  only: it creates, updates and deletes the run's streams, before any role starts. Its
  credentials live apart (``admin_directory``, outside the run directory): a role
  process is only ever handed the path of its own file, and cannot read the launcher's
  (``hidden_from``: ``bus.sandbox`` hides it from the role processes the launcher
  starts; across hosts, each host is given only its roles' files).

    auth = RunAuth.ensure(paths.auth, run)      # made once, the same passwords afterwards
    auth = auth.declare({"trainer": ["trainer"], "env": ["env-reverse-text"]})
    auth.users()                                 # nats-server's authorization users
    auth.creds_file("env")                       # what an env process connects with

    python -m bus.auth                           # prints the permission table
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bus.kinds import KINDS, check_kind, kind_of_role, kinds_that, object_kinds, producers
from bus.subjects import (
    INFER,
    TOPICS,
    Topic,
    check_token,
    filter_subject,
    infer_patterns,
    objects_bucket,
    relative_subject,
    role_keys_pattern,
    roles_bucket_name,
    run_pattern,
    stream_name,
    subject,
)

CREDS_ENV = "RLBUS_NATS_CREDS"  # a credentials file to connect with (``--creds``)
TLS_CA_ENV = "RLBUS_NATS_CA"  # the CA file that signs the servers' certificates (bus.tls_ca)


def user_name(run: str, kind: str) -> str:
    return f"{check_token(run, 'run id')}.{check_kind(kind)}"


def inbox_prefix(run: str, kind: str) -> str:
    """Where an identity's replies arrive: nats-py makes inboxes ``<prefix>.<nuid>``."""
    return f"_INBOX_{check_token(run, 'run id')}_{check_kind(kind)}"


def _names(run: str) -> tuple[str, list[str], str, str]:
    """(stream, the object stores' streams, registry bucket, its stream): the streams
    behind an object store and a KV bucket are ``OBJ_<bucket>``, ``KV_<bucket>``."""
    roles = roles_bucket_name(run)
    return stream_name(run), [f"OBJ_{b}" for b in run_buckets(run)], roles, f"KV_{roles}"


def kind_buckets(run: str) -> list[str]:
    """The object store of each kind of ``run`` that stores objects
    (``bus.subjects.objects_bucket``): what the launcher creates before roles start."""
    return [objects_bucket(run, k) for k in object_kinds()]


def run_buckets(run: str) -> list[str]:
    """Every object store of ``run``: the shared one (an anonymous bus's), then each
    kind's."""
    return [objects_bucket(run), *kind_buckets(run)]


def _read_api(streams: list[str], consumers: list[str]) -> list[str]:
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


def _admin_api(streams: list[str]) -> list[str]:
    """Everything on ``streams``: create, update, delete, purge, messages, consumers."""
    out = []
    for s in streams:
        out += [f"$JS.API.STREAM.*.{s}", f"$JS.API.STREAM.MSG.*.{s}"]
        out += [f"$JS.API.DIRECT.GET.{s}", f"$JS.API.DIRECT.GET.{s}.>"]
        out += [f"$JS.API.CONSUMER.*.{s}", f"$JS.API.CONSUMER.*.{s}.>"]
        out += [f"$JS.API.CONSUMER.DURABLE.CREATE.{s}.>", f"$JS.API.CONSUMER.MSG.NEXT.{s}.>"]
        out += [f"$JS.ACK.{s}.>", f"$JS.FC.{s}.>"]
    return [*out, "$JS.API.STREAM.NAMES"]


def _durable_api(stream: str, durable: str) -> list[str]:
    """Owning durable consumer ``durable`` (or ``*``, any): create it (either API),
    fetch from it, ack its messages, delete it."""
    return [
        f"$JS.API.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}",
        f"$JS.API.CONSUMER.CREATE.{stream}.{durable}.>",
        f"$JS.API.CONSUMER.DELETE.{stream}.{durable}",
        f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _topics(run: str, kind: str) -> list[str]:
    """The subjects of the topics ``kind`` produces; dead letters only under its own
    role names (``dead.lettered.<role>``: no kind speaks for another's consumers)."""
    out = []
    for t in TOPICS:
        if kind not in producers(t):
            continue
        if t == Topic.DEAD_LETTERED:
            out += [subject(run, t, role) for role in KINDS[kind].heartbeats]
        else:
            out.append(filter_subject(run, t))
    return out


Durables = dict[str, list[str]]  # kind -> the durable consumer names it owns


def owned_durables(kind: str, durables: Durables | None) -> list[str]:
    """The durable names ``kind`` may use: its own of ``durables`` (the run's, from its
    config: ``RunAuth.durables``); any name (``*``) for ``attach`` (workers attached at
    run time name theirs) and for every kind when the run declared none."""
    if not KINDS[kind].durables:
        return []
    if durables is None or kind == "attach":
        return ["*"]
    return list(durables.get(kind, []))


def _permissions(run: str, kind: str, durables: Durables | None) -> dict[str, Any]:
    stream, obj_streams, roles, kv_stream = _names(run)
    inbox = f"{inbox_prefix(run, kind)}.>"
    if kind == "launcher":
        pub = [run_pattern(run), f"$KV.{roles}.>"] + [f"$O.{b}.>" for b in run_buckets(run)]
        pub += _admin_api([stream, *obj_streams, kv_stream])
        return {"publish": {"allow": pub}, "subscribe": {"allow": [inbox, run_pattern(run)]}}
    spec = KINDS[kind]
    pub = _topics(run, kind)
    if spec.infer == "asks":
        pub += infer_patterns(run)  # a model, or one replica
    if spec.objects:  # its own store: chunks and meta; a replaced or deleted object's
        own = objects_bucket(run, kind)  # chunks are purged
        pub += [f"$O.{own}.>", f"$JS.API.STREAM.PURGE.OBJ_{own}"]
    pub += [f"$KV.{roles}.{role_keys_pattern(run, role)}" for role in spec.heartbeats]
    pub += _read_api([stream, *obj_streams, kv_stream], [stream, *obj_streams])
    if spec.infer == "answers":  # signs of life and the reply (``bus.rpc``) go to an
        # asker's inbox: a random token, known only to whoever received the request
        pub += [f"{inbox_prefix(run, k)}.>" for k in kinds_that("asks")]
    mine = owned_durables(kind, durables)
    for durable in mine:
        pub += _durable_api(stream, durable)
    publish: dict[str, list[str]] = {"allow": pub}
    if durables is not None:  # the others' durables: not even through the read API
        others = {d for k, names in durables.items() if k != kind for d in names} - set(mine)
        if kind == "attach":  # both run algorithm workers: the same names
            others -= set(durables.get("algorithm", []))
        publish["deny"] = [p for d in sorted(others) for p in _durable_api(stream, d)]
    sub = [inbox]
    perms: dict[str, Any] = {"publish": publish, "subscribe": {"allow": sub}}
    if spec.infer == "answers":
        sub += infer_patterns(run)
        perms["allow_responses"] = True
    return perms


def permissions(run: str, kind: str, durables: Durables | None = None) -> dict[str, Any]:
    """The nats-server ``permissions`` object of ``kind``'s identity in ``run``, its
    durable consumers confined to ``durables`` when the run declared them."""
    return _permissions(check_token(run, "run id"), check_kind(kind), durables)


def permission_rows(durables: Durables | None = None) -> list[tuple[str, str, str]]:
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
        own = objects_bucket(run, kind).removesuffix(run) + "<run>"
        pub += [f"its own objects ({own})"] if spec.objects else []
        pub += [f"heartbeats ({', '.join(spec.heartbeats)})"] if spec.heartbeats else []
        consume = ["reads the log, objects, registry"]
        if kind == "attach":
            consume.append("durable consumers of any name but the other kinds'")
        elif spec.durables and durables is None:
            consume.append("its own durable consumers (the run's config names them)")
        elif spec.durables:
            consume.append(f"durable consumers {', '.join(owned_durables(kind, durables))}")
        if spec.infer == "answers":
            consume.append(
                f"answers {INFER}.* (replies and signs of life into the askers' inboxes)"
            )
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

    @property
    def kind(self) -> str:
        """The role kind of this identity (its user is ``<run>.<kind>``)."""
        return self.user.rsplit(".", 1)[-1]


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


DURABLES_FILE = "durables.json"  # in a run's auth directory: kind -> its durable names


RUN_AUTH = "auth"  # a run's auth directory: ``<data>/<run>/auth`` (configs.paths.RunPaths)
ADMIN_ROOT = ".admin"  # ``<data>/.admin/<run>``: each run's launcher credentials, server configs


def admin_directory(directory: str | Path) -> Path:
    """Where the launcher's credentials (and its servers' configurations, which hold every
    password: ``bus.server``) live, for the run whose auth directory is ``directory``.
    For a run under a data directory (``<data>/<run>/auth``) it is ``<data>/.admin/<run>``:
    outside every run directory, so a role's sandbox hides all of ``<data>/.admin`` and
    leaves its run directory whole (``hidden_from``). Elsewhere (``rlbus nats config
    --out``): ``<directory>-admin`` beside it. A role process is never handed a path here."""
    d = Path(directory)
    if d.name == RUN_AUTH:
        return d.parent.parent / ADMIN_ROOT / d.parent.name
    return _beside(d)


def _beside(directory: Path) -> Path:
    """``<directory>-admin``: the admin directory outside a run layout (and a run's own
    before ``.admin``, which ``RunAuth.ensure`` moves from)."""
    return directory.with_name(f"{directory.name}-admin")


def creds_path(directory: str | Path, kind: str) -> Path:
    """The credentials file of ``kind`` (a role name is taken as its kind) of the run
    whose auth directory is ``directory``."""
    kind = kind_of_role(kind)
    base = admin_directory(directory) if kind == "launcher" else Path(directory)
    return base / f"{kind}.creds"


def hidden_from(directory: str | Path) -> list[Path]:
    """What a role process of the run whose auth directory is ``directory`` must not read
    or write (``bus.sandbox`` hides it): every run's launcher credentials and server
    configurations (``<data>/.admin``), and the other runs' credentials and stores
    (``nats/``: an older layout kept its configuration there). (Its own run's directory
    stays whole, the other kinds' credentials in it included: a boundary between the
    kinds of one run needs separate hosts or OS users.) Nothing when the run has no auth
    directory: its server lets anyone in."""
    d = Path(directory).absolute()
    if not d.is_dir():
        return []
    run_dir, data = d.parent, d.parent.parent
    others: list[Path] = []
    for entry in data.iterdir():
        if entry != run_dir and entry.name != ADMIN_ROOT:
            auth = entry / RUN_AUTH
            others += [auth, _beside(auth), entry / "nats"]
    return [data / ADMIN_ROOT, *others]


@dataclass(frozen=True)
class RunAuth:
    """The identities of one run, kept in ``directory`` (``runs/<run>/auth``, mode 0700):
    one credentials file per kind (``<kind>.creds``, JSON, mode 0600), the launcher's in
    ``admin_directory`` (mode 0700), and the durable consumers each kind owns
    (``durables.json``, written by the launcher from the run's config: ``declare``)."""

    directory: Path
    run: str
    _passwords: dict[str, str] = field(repr=False)
    durables: Durables | None = None

    @classmethod
    def ensure(cls, directory: str | Path, run: str) -> RunAuth:
        """The run's credentials: made for every kind missing, read back otherwise (a
        restarted server and the roles still running must agree on them)."""
        check_token(run, "run id")
        d = Path(directory)
        for sub in (d, admin_directory(d)):
            sub.mkdir(mode=0o700, parents=True, exist_ok=True)
            sub.chmod(0o700)
        # A run made before the admin directory, or when it sat beside the auth directory
        # (``<run>/auth-admin``): its launcher credentials move there.
        # A copy left where role processes can reach it is removed once the file is there.
        for old in (d / "launcher.creds", _beside(d) / "launcher.creds"):
            if old == creds_path(d, "launcher"):
                continue
            with contextlib.suppress(FileNotFoundError):  # (a concurrent ensure moved it)
                if not creds_path(d, "launcher").exists():
                    old.rename(creds_path(d, "launcher"))
                else:
                    old.unlink()
        passwords = {}
        for kind in KINDS:
            path = creds_path(d, kind)
            if not path.exists():
                _create(path, _creds_doc(run, kind, secrets.token_urlsafe(32)))
            data = json.loads(path.read_text())
            if (data.get("run"), data.get("kind")) != (run, kind):
                raise ValueError(f"{path} holds credentials of another run or kind")
            passwords[kind] = str(data["password"])
        durables = None
        if (file := d / DURABLES_FILE).exists():
            durables = {
                str(k): [str(n) for n in v] for k, v in json.loads(file.read_text()).items()
            }
        return cls(d, run, passwords, durables)

    def declare(self, durables: Durables) -> RunAuth:
        """Confine each kind's durable consumers to ``durables`` (kind -> names) from now
        on (the server's users made afterwards; ``attach`` keeps any name but these)."""
        for kind, names in durables.items():
            check_kind(kind)
            for name in names:
                check_token(name, "durable name")
        path = self.directory / DURABLES_FILE
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
        tmp.write_text(json.dumps(durables, sort_keys=True))
        tmp.chmod(0o600)
        tmp.replace(path)
        return dataclasses.replace(self, durables={k: list(v) for k, v in durables.items()})

    def creds_file(self, kind: str) -> Path:
        """The credentials file of ``kind`` (a role name is taken as its kind)."""
        return creds_path(self.directory, kind)

    def creds(self, kind: str) -> ClientCreds:
        return load_creds(self.creds_file(kind))

    def users(self) -> list[dict[str, Any]]:
        """The run's entries of nats-server's ``authorization.users``."""
        return [
            {
                "user": user_name(self.run, kind),
                "password": self._passwords[kind],
                "permissions": permissions(self.run, kind, self.durables),
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
