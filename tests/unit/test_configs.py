"""Unit tests for configs: presets, overrides, errors, deprecations, TOML round trip."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from configs import (
    ConfigDeprecationWarning,
    ConfigError,
    RunConfig,
    apply_overrides,
    dump_toml,
    list_presets,
    load_config,
    parse_value,
    resolve,
)
from configs.toml_emit import dumps

REPO = Path(__file__).parents[2]


def test_presets_load_with_the_documented_values():
    """Both bundled presets validate and carry the values `just up` / smoke rely on."""
    assert {"default", "smoke"} <= set(list_presets())
    cfg = load_config()
    assert cfg == load_config("default")
    assert cfg.max_steps == 500 and cfg.orchestrator.batch_size == 64
    assert [e.id for e in cfg.orchestrator.train.env] == ["reverse-text"]
    assert cfg.orchestrator.train.env[0].group_size == 8
    assert (cfg.orchestrator.warmup.steps, cfg.orchestrator.warmup.lr) == (120, 3e-3)
    assert cfg.orchestrator.models["teacher"].kind == "teacher"
    assert [a.id for a in cfg.orchestrator.algorithms] == ["grpo"]
    assert (cfg.orchestrator.eval.interval, cfg.orchestrator.eval.k) == (50, 4)
    assert cfg.orchestrator.algorithms[0].options == {"std_normalize": True}
    smoke = load_config("smoke")
    assert (smoke.max_steps, smoke.orchestrator.batch_size) == (3, 8)
    assert smoke.orchestrator.train.env[0].group_size == 4
    assert smoke.orchestrator.warmup.steps == 1
    assert (smoke.orchestrator.eval.num_tasks, smoke.orchestrator.eval.interval) == (4, 2)
    assert smoke.orchestrator.train.sampling.max_completion_tokens == 16


def test_library_defaults_form_a_valid_config():
    """RunConfig() with no input is valid (roles and tests build configs from it)."""
    cfg = RunConfig()
    assert cfg.orchestrator.algorithms[0].name == "grpo"
    assert cfg.orchestrator.train.env[0].id == "reverse-text"
    assert cfg.bus.offload_threshold_bytes == 512 * 1024


def test_load_config_accepts_a_file_path(tmp_path):
    """A path to a TOML file loads like a preset; unset keys take library defaults."""
    path = tmp_path / "mine.toml"
    path.write_text('run = "exp-1"\n[trainer]\nlr = 1e-3\n')
    cfg = load_config(path)
    assert cfg.run == "exp-1" and cfg.trainer.lr == 1e-3
    assert load_config(str(path)) == cfg


def test_overrides_set_typed_values_by_dotted_key():
    """Override values parse as TOML (float, bool, list) and fall back to plain strings."""
    cfg = load_config(
        "default",
        [
            "trainer.lr=1e-4",
            "orchestrator.train.sampling.temperature=0.7",
            "bus.url=nats://127.0.0.1:4222",
            'orchestrator.eval.env=[{id="reverse-text", num_tasks=2}]',
            "orchestrator.skip_zero_advantage_groups=false",
            "trainer.betas=[0.8, 0.9]",
            "orchestrator.train.env.0.args.words=[1, 2]",
            "run=my-run_2",
        ],
    )
    assert cfg.trainer.lr == 1e-4
    assert cfg.orchestrator.train.sampling.temperature == 0.7
    assert cfg.bus.url == "nats://127.0.0.1:4222"
    assert [(e.id, e.num_tasks) for e in cfg.orchestrator.eval.env] == [("reverse-text", 2)]
    assert cfg.orchestrator.skip_zero_advantage_groups is False
    assert cfg.trainer.betas == (0.8, 0.9)
    assert cfg.orchestrator.train.env[0].args == {"words": [1, 2]}
    assert cfg.run == "my-run_2"


def test_parse_value_types():
    """TOML scalars and arrays are typed; anything else stays the literal string."""
    assert parse_value("1e-4") == 1e-4
    assert parse_value("3") == 3
    assert parse_value("true") is True
    assert parse_value("[1,2]") == [1, 2]
    assert parse_value('"007"') == "007"
    assert parse_value("Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"


def test_override_indexes_into_a_list_of_tables():
    """`orchestrator.train.env.0.group_size=4` edits the first env; index len appends."""
    cfg = load_config("default", ["orchestrator.train.env.0.group_size=4"])
    assert cfg.orchestrator.train.env[0].group_size == 4
    cfg = load_config(
        "default", ["orchestrator.train.env.1.id=other", "orchestrator.train.env.1.ratio=2"]
    )
    assert [(e.id, e.ratio) for e in cfg.orchestrator.train.env] == [
        ("reverse-text", 1.0),
        ("other", 2.0),
    ]
    with pytest.raises(ConfigError, match=r"orchestrator\.train\.env\.5.*out of range"):
        load_config("default", ["orchestrator.train.env.5.group_size=4"])


def test_apply_overrides_does_not_mutate_its_input():
    """apply_overrides is pure: the caller's raw dict is left untouched."""
    raw = {"trainer": {"lr": 1.0}}
    assert apply_overrides(raw, ["trainer.lr=2.0"]) == {"trainer": {"lr": 2.0}}
    assert raw == {"trainer": {"lr": 1.0}}


def test_malformed_override_fails_clearly():
    """An override without `=` or into a scalar is a ConfigError naming it."""
    with pytest.raises(ConfigError, match="dotted.key=value"):
        load_config("default", ["trainer.lr"])
    with pytest.raises(ConfigError, match=r"`trainer\.lr` is a value"):
        load_config("default", ["trainer.lr.x=1"])


def test_unknown_key_fails_naming_the_full_dotted_path():
    """A typo fails at load naming the whole path (and suggesting the real key)."""
    with pytest.raises(ConfigError) as err:
        load_config("default", ["orchestrator.train.sampling.temprature=0.5"])
    msg = str(err.value)
    assert "unknown key `orchestrator.train.sampling.temprature`" in msg
    assert "orchestrator.train.sampling.temperature" in msg
    with pytest.raises(ConfigError, match=r"unknown key `orchestrator\.train\.env\.0\.groupsize`"):
        load_config("default", ["orchestrator.train.env.0.groupsize=3"])
    with pytest.raises(ConfigError, match=r"unknown key `orchestrator\.models\.teacher\.kindd`"):
        load_config("default", ["orchestrator.models.teacher.kindd=x"])


def test_bad_type_names_the_key():
    """A value of the wrong type names its dotted path and pydantic's reason."""
    with pytest.raises(ConfigError, match=r"`trainer\.lr`: Input should be a valid number"):
        load_config("default", ["trainer.lr=fast"])
    with pytest.raises(ConfigError, match=r"`orchestrator\.train\.sampling\.top_p`"):
        load_config("default", ["orchestrator.train.sampling.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"`run`"):
        load_config("default", ["run=has.dot"])


def test_all_errors_are_reported_at_once():
    """Several bad keys produce one error listing each, so one fix cycle suffices."""
    with pytest.raises(ConfigError) as err:
        resolve({"trainer": {"lr": "x", "nope": 1}, "seed": "y"})
    msg = str(err.value)
    assert "`trainer.lr`" in msg and "unknown key `trainer.nope`" in msg and "`seed`" in msg


def test_missing_file_and_bad_toml_name_the_file(tmp_path):
    """A missing file names its path; a TOML syntax error names the file and line."""
    with pytest.raises(ConfigError, match="no-such.toml"):
        load_config(tmp_path / "no-such.toml")
    with pytest.raises(ConfigError, match="not a preset"):
        load_config("no-such-preset")
    bad = tmp_path / "bad.toml"
    bad.write_text("seed = 1\n[trainer\nlr = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml.*line 2"):
        load_config(bad)


ORCH = "orchestrator"
DEPRECATED = [  # (raw config, old path, new path, reads the translated value back)
    (
        {ORCH: {"sampling": {"top_k": 7}}},
        f"{ORCH}.sampling",
        f"{ORCH}.train.sampling",
        lambda o: o.train.sampling.top_k,
    ),
    (
        {ORCH: {"env": [{"id": "e", "group_size": 7}]}},
        f"{ORCH}.env",
        f"{ORCH}.train.env",
        lambda o: o.train.env[0].group_size,
    ),
    (
        {ORCH: {"train": {"sampling": {"max_tokens": 7}}}},
        f"{ORCH}.train.sampling.max_tokens",
        f"{ORCH}.train.sampling.max_completion_tokens",
        lambda o: o.train.sampling.max_completion_tokens,
    ),
    (
        {ORCH: {"train": {"env": [{"id": "e", "sampling": {"max_tokens": 7}}]}}},
        f"{ORCH}.train.env.0.sampling.max_tokens",
        f"{ORCH}.train.env.0.sampling.max_completion_tokens",
        lambda o: o.train.env[0].sampling.max_completion_tokens,
    ),
    (
        {ORCH: {"eval": {"sampling": {"max_tokens": 7}}}},
        f"{ORCH}.eval.sampling.max_tokens",
        f"{ORCH}.eval.sampling.max_completion_tokens",
        lambda o: o.eval.sampling.max_completion_tokens,
    ),
]


@pytest.mark.parametrize(("raw", "old", "new", "read"), DEPRECATED)
def test_deprecated_spelling_translates_and_warns_once(raw, old, new, read):
    """Each old spelling still works, means the same as the new one, and warns once naming both."""
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = resolve(raw)
    assert len(record) == 1
    assert str(record[0].message) == f"`{old}` is deprecated; use `{new}`"
    assert read(cfg.orchestrator) == 7


def test_deprecated_spelling_in_a_file_warns_once_and_overrides_use_new_paths(tmp_path):
    """A file with `[[orchestrator.env]]` loads; overrides then address the new path."""
    path = tmp_path / "old.toml"
    path.write_text('[[orchestrator.env]]\nid = "reverse-text"\n')
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config(path, ["orchestrator.train.env.0.group_size=2"])
    assert len(record) == 1
    assert cfg.orchestrator.train.env[0].group_size == 2


def test_deprecated_override_keys_translate_against_new_presets():
    """Old run scripts' override keys still work on presets that use the new spelling."""
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config("smoke", ["orchestrator.sampling.max_tokens=64"])
    assert [str(r.message) for r in record] == [
        "`orchestrator.sampling` is deprecated; use `orchestrator.train.sampling`",
        "`orchestrator.train.sampling.max_tokens` is deprecated; "
        "use `orchestrator.train.sampling.max_completion_tokens`",
    ]
    assert cfg.orchestrator.train.sampling.max_completion_tokens == 64
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config("smoke", ["orchestrator.env.0.sampling.max_tokens=5"])
    assert len(record) == 2
    assert cfg.orchestrator.train.env[0].sampling.max_completion_tokens == 5


def test_a_removed_key_is_dropped_with_its_reason_in_a_file_and_in_an_override(tmp_path):
    """`inference.continuous_batching` (the engine has one decode loop now) still loads:
    dropped with a warning saying why, from a file and from an override alike."""
    path = tmp_path / "old.toml"
    path.write_text("[inference]\ncontinuous_batching = true\nmax_batch_size = 32\n")
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config(path)
    assert [str(r.message) for r in record] == [
        "`inference.continuous_batching` is removed and ignored: the torch engine always "
        "admits requests into its running decode loop between steps "
        "(roles/inference/engine.py); there is no static mode left to choose"
    ]
    assert cfg.inference.max_batch_size == 32
    with pytest.warns(ConfigDeprecationWarning, match="continuous_batching` is removed"):
        cfg = load_config("smoke", ["inference.continuous_batching=false"])
    assert not hasattr(cfg.inference, "continuous_batching")


@pytest.mark.parametrize(
    "raw",
    [
        {"orchestrator": {"sampling": {}, "train": {"sampling": {}}}},
        {"orchestrator": {"env": [{"id": "a"}], "train": {"env": [{"id": "b"}]}}},
        {"orchestrator": {"train": {"sampling": {"max_tokens": 1, "max_completion_tokens": 2}}}},
    ],
)
def test_old_and_new_spelling_together_fail(raw):
    """Giving both spellings of one key is an error naming both, not a silent pick."""
    with pytest.raises(ConfigError, match="deprecated.*keep only"):
        resolve(raw)


def test_eval_envs_list_is_the_deprecated_spelling_of_eval_env_entries(tmp_path):
    """`[orchestrator.eval] envs = ["a"]` (file or override, whole list or one element)
    means `[[orchestrator.eval.env]] id = "a"` and warns once naming both; both at once
    is an error."""
    message = "`orchestrator.eval.envs` is deprecated; use `orchestrator.eval.env`"
    path = tmp_path / "old.toml"
    path.write_text('[orchestrator.eval]\nenvs = ["reverse-text"]\n')
    for load in (
        lambda: load_config(path),
        lambda: load_config("smoke", ['orchestrator.eval.envs=["reverse-text"]']),
        lambda: load_config("smoke", ["orchestrator.eval.envs.0=reverse-text"]),
    ):
        with pytest.warns(ConfigDeprecationWarning) as record:
            cfg = load()
        assert [str(r.message) for r in record] == [message]
        assert [e.id for e in cfg.orchestrator.eval.env] == ["reverse-text"]
    with pytest.raises(ConfigError, match="deprecated.*keep only"):
        resolve({ORCH: {"eval": {"envs": ["a"], "env": [{"id": "a"}]}}})


EVAL_ENVS = (
    'orchestrator.eval.env=[{id="reverse-text"}, {id="alphabet-sort", num_tasks=3, '
    "replicas=2, sampling={max_completion_tokens=7}}]"
)


def test_eval_env_entries_inherit_the_eval_defaults_and_round_trip():
    """An eval env entry's sampling keys left out come from `orchestrator.eval.sampling`,
    its task count from `num_tasks`, a train env's args from its train entry; the
    resolved config dumps and loads back equal; eval-only envs are the entries naming no
    train env, and only while the run evaluates."""
    cfg = load_config("smoke", ["orchestrator.train.env.0.args={max_len=5}", EVAL_ENVS])
    rev, alpha = cfg.orchestrator.eval_targets()
    assert (rev.id, rev.num_tasks, rev.args, rev.train is not None) == (
        "reverse-text", 4, {"max_len": 5}, True,
    )  # fmt: skip
    assert rev.sampling == cfg.orchestrator.eval.sampling
    assert (alpha.num_tasks, alpha.train, alpha.args) == (3, None, {})
    assert alpha.sampling.max_completion_tokens == 7 and alpha.sampling.temperature == 0.0
    assert [e.id for e in cfg.orchestrator.eval_only_envs()] == ["alphabet-sort"]
    assert cfg.orchestrator.eval_only_envs()[0].pool == (2, 2)
    assert resolve(tomllib.loads(dump_toml(cfg))) == cfg
    off = load_config("smoke", [EVAL_ENVS, "orchestrator.eval.interval=0"])
    assert off.orchestrator.eval_only_envs() == []
    default = load_config("smoke").orchestrator
    assert [(t.id, t.num_tasks) for t in default.eval_targets()] == [("reverse-text", 4)]


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ('[{id="alphabet-sort"}, {id="alphabet-sort"}]', "`orchestrator.eval.env`: id 'alphabet-sort' is listed more than once"),
        ('[{id="reverse-text", replicas=2}]', "`orchestrator.eval.env.0.replicas`: 'reverse-text' is a train env"),
        ('[{id="a.b"}, {id="a:b"}]', "`orchestrator.eval.env`: ids ['a.b', 'a:b'] share the subject key 'a-b'"),
        ('[{id="x", num_tasks=0}]', "`orchestrator.eval.env.0.num_tasks`"),
    ],
)  # fmt: skip
def test_bad_eval_env_entries_are_refused_naming_the_key(entries, message):
    """Duplicates, pool settings on a train env (served by its train pool), two ids on
    one subject key, and bad values fail at load, naming the key."""
    with pytest.raises(ConfigError) as e:
        load_config("smoke", [f"orchestrator.eval.env={entries}"])
    assert message in str(e.value)


def test_per_env_sampling_inherits_unset_keys_from_train_sampling():
    """An env's sampling table overrides only the keys it sets."""
    cfg = load_config("smoke", ["orchestrator.train.env.0.sampling.temperature=0.5"])
    env_sampling = cfg.orchestrator.train.env[0].sampling
    assert env_sampling is not None
    assert env_sampling.temperature == 0.5
    assert env_sampling.max_completion_tokens == 16  # from orchestrator.train.sampling


def test_unknown_actor_fails():
    """`orchestrator.actor` must be "policy" or a declared model key."""
    with pytest.raises(ConfigError, match=r"`orchestrator\.actor` = 'nobody'"):
        load_config("default", ["orchestrator.actor=nobody"])
    assert load_config("default", ["orchestrator.actor=teacher"]).orchestrator.actor == "teacher"


def test_env_referencing_undeclared_algorithm_fails():
    """An env's `algorithms` entries must be ids from `orchestrator.algorithms`."""
    with pytest.raises(ConfigError, match=r"`orchestrator\.train\.env\.0\.algorithms` names 'ppo'"):
        load_config("default", ['orchestrator.train.env.0.algorithms=["ppo"]'])


def test_other_cross_field_rules():
    """Duplicate ids, a warmup actor missing from models, and bad trust regions fail."""
    with pytest.raises(ConfigError, match="'grpo' is declared more than once"):
        load_config("default", ["orchestrator.algorithms.1.id=grpo"])
    with pytest.raises(ConfigError, match="'reverse-text' is declared more than once"):
        load_config("default", ["orchestrator.train.env.1.id=reverse-text"])
    with pytest.raises(ConfigError, match=r"`orchestrator\.warmup\.actor`"):
        resolve({"orchestrator": {"warmup": {"steps": 2, "actor": "teacher"}}})
    assert resolve({"orchestrator": {"warmup": {"steps": 0}}}).orchestrator.warmup.steps == 0
    with pytest.raises(ConfigError, match=r"`trainer\.loss\.trust_region_low`"):
        load_config("default", ["trainer.loss.trust_region_low=0"])


@pytest.mark.parametrize("preset", ["default", "smoke"])
def test_dump_toml_round_trips(preset):
    """dump_toml writes every resolved key; loading it back gives an equal config."""
    cfg = load_config(preset)
    text = dump_toml(cfg)
    assert resolve(tomllib.loads(text)) == cfg
    assert cfg.model_dump(mode="json")["trainer"]["betas"] == [0.9, 0.999]


def test_dump_toml_round_trips_awkward_values():
    """Strings needing escapes, nested args, per-env sampling and extra envs survive."""
    cfg = load_config(
        "default",
        [
            'orchestrator.train.sampling.stop=["\\n", "say \\"hi\\"", "tab\\t\\\\"]',
            'orchestrator.train.env.0.args={ words = 3, "odd key" = { x = [1, 2.5] } }',
            "orchestrator.train.env.0.sampling.top_k=5",
            "orchestrator.train.env.1.id=second",
            'orchestrator.train.env.1.algorithms=["grpo"]',
            "orchestrator.algorithms.1.id=shadow-grpo",
            "orchestrator.algorithms.1.name=grpo",
            "orchestrator.algorithms.1.shadow=true",
            "orchestrator.models.ref.kind=reference",
            "run=r1",
        ],
    )
    assert resolve(tomllib.loads(dump_toml(cfg))) == cfg


def test_toml_emitter_handles_nested_tables_and_arrays():
    """The emitter's output parses back to the same plain data."""
    data = {
        "a": 1,
        "b": {"c": {"d": True}, "e": []},
        "f": [{"g": {"h": "x"}}, {"i": [{"j": 1.5}]}],
        "k": [1, "two", {"three": 3}],
        "empty": {},
    }
    assert tomllib.loads(dumps(data)) == data


def test_importing_configs_does_not_import_torch():
    """configs stays light: the CLI imports it before deciding it needs torch."""
    code = "import configs, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


_scalars = (
    st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False)
    | st.text()
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=12,
)


@given(st.dictionaries(st.text(max_size=5), _values, max_size=5))
def test_toml_emitter_round_trips_arbitrary_data(data):
    """Any None-free nest of TOML-representable values parses back unchanged."""
    assert tomllib.loads(dumps(data)) == data


def test_default_preset_documents_every_key():
    """default.toml is user documentation: each key line has a comment line above it."""
    lines = (REPO / "configs/presets/default.toml").read_text().splitlines()
    for i, line in enumerate(lines):
        is_key = "=" in line and not line.startswith(("#", "["))
        if is_key:
            assert lines[i - 1].startswith("#"), f"undocumented key: {line!r}"


def test_env_server_groups_in_flight_reaches_the_env_servers_consumer():
    """`env_server.groups_in_flight` is what the env server's task consumer runs at once:
    the config maps to EnvServer's arguments, which set its Subscription's concurrency."""
    from types import SimpleNamespace

    from bus.log import get_logger
    from roles.env_server.role import EnvServer, server_options
    from roles.runtime.context import RoleContext

    assert load_config("default").env_server.groups_in_flight == 8
    cfg = load_config("smoke", ["env_server.groups_in_flight=3", "bus.heartbeat_interval_s=0.5"])
    ctx = RoleContext(run="r", url="nats://unused", cfg=cfg, instance="env-test")
    options = server_options(ctx, "reverse-text")
    assert options["concurrency"] == 3 and options["heartbeat_interval_s"] == 0.5
    bus = SimpleNamespace(run="r", log=get_logger())  # no broker: only the declarations
    server = EnvServer(bus, "env-test", "reverse-text", None, None, **options)  # type: ignore[arg-type]
    (sub,) = server.subscriptions()
    assert sub.concurrency == 3 and sub.batch == 3
    with pytest.raises(ConfigError, match="env_server.groups_in_flight"):
        load_config("smoke", ["env_server.groups_in_flight=0"])


def test_data_dir_resolves_flag_then_env_then_config(monkeypatch, tmp_path):
    """One resolution for every command and role: an explicit flag or `bus.data_dir`
    override, then $RLBUS_DATA_DIR, then the config's `bus.data_dir`."""
    from configs.paths import RunPaths, resolve_data_dir, settle_data_dir

    monkeypatch.delenv("RLBUS_DATA_DIR", raising=False)
    assert resolve_data_dir() == Path("runs")
    assert resolve_data_dir(configured="cfg") == Path("cfg")
    monkeypatch.setenv("RLBUS_DATA_DIR", str(tmp_path / "env"))
    assert resolve_data_dir(configured="cfg") == tmp_path / "env"
    assert resolve_data_dir("flag", "cfg") == Path("flag")
    cfg = load_config("smoke", ["run=r1"])
    assert settle_data_dir(cfg).bus.data_dir == str(tmp_path / "env")
    overrides = ["bus.data_dir=/x/runs"]
    assert settle_data_dir(load_config("smoke", overrides), overrides).bus.data_dir == "/x/runs"
    assert settle_data_dir(load_config("smoke"), flag="f").bus.data_dir == "f"
    paths = RunPaths.of(cfg)
    assert paths.dir == tmp_path / "env" / "r1" and RunPaths.at(paths.dir) == paths
    assert (
        paths.nats == paths.dir / "nats"
        and paths.log("trainer") == paths.dir / "logs" / "trainer.log"
    )


def test_run_paths_server_file_is_what_the_embedded_server_writes(tmp_path):
    """configs imports no bus: RunPaths spells the server file's name, bus.server writes it."""
    from bus.server import EmbeddedServer
    from configs.paths import RunPaths

    paths = RunPaths(tmp_path, "r")
    assert EmbeddedServer(paths.nats).info_path == paths.server_file
