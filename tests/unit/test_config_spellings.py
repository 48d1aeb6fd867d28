"""A prime-rl user's config spellings load (issue 34): each is read as rlbus's key, with
one warning naming both (or none, for an equal spelling), in a TOML file and in a
`key=value` override; a malformed one is refused naming the key. The table of them is
docs/configuration.md, "prime-rl spellings"; the rules are configs/deprecations.py."""

from __future__ import annotations

import tomllib
import warnings
from pathlib import Path

import pytest

from configs import (
    ConfigDeprecationWarning,
    ConfigError,
    OrchestratorConfig,
    RunConfig,
    dump_toml,
    load_config,
    resolve,
)
from configs.deprecations import AUTO_MAX_REPLICAS

ORCH = "orchestrator"
ENV0 = "orchestrator.train.env.0"


def load(tmp_path: Path, text: str, *overrides: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, list(overrides))


def warned_once(record: pytest.WarningsRecorder, old: str, new: str) -> str:
    """The one warning recorded, which names the old and the new key."""
    assert [type(r.message) for r in record] == [ConfigDeprecationWarning], [
        str(r.message) for r in record
    ]
    message = str(record[0].message)
    assert f"`{old}`" in message and f"`{new}`" in message, message
    return message


def silently(load_it):  # type: ignore[no-untyped-def]
    """`load_it()`, failing on any warning (an equal spelling warns about nothing)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return load_it()


# -- 1. bare algorithm ids -----------------------------------------------------------


def test_bare_algorithm_ids_are_tables_in_a_file_and_an_override(tmp_path: Path) -> None:
    """`algorithms = ["grpo", "rloo"]`, also mixed with tables, is `[[orchestrator.algorithms]]`
    with those ids: an equal spelling, no warning. As an override the ids merge with the
    file's entries like tables with those ids would (the preset's grpo keeps its options)."""
    text = '[orchestrator]\nalgorithms = ["grpo", {id = "shadow", name = "rloo", shadow = true}]\n'
    cfg = silently(lambda: load(tmp_path, text))
    grpo, shadow = cfg.orchestrator.algorithms
    assert (grpo.id, grpo.name, grpo.options, grpo.shadow) == ("grpo", "grpo", {}, False)
    assert (shadow.id, shadow.name, shadow.shadow) == ("shadow", "rloo", True)

    cfg = silently(lambda: load_config("default", ['orchestrator.algorithms=["grpo","rloo"]']))
    assert [(a.id, a.options) for a in cfg.orchestrator.algorithms] == [
        ("grpo", {"std_normalize": True}),
        ("rloo", {}),
    ]
    partial = silently(lambda: OrchestratorConfig.model_validate({"algorithms": ["rloo"]}))
    assert [a.id for a in partial.algorithms] == ["rloo"]


def test_an_algorithm_entry_that_is_neither_an_id_nor_a_table_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"`orchestrator\.algorithms\.1`"):
        load(tmp_path, '[orchestrator]\nalgorithms = ["grpo", 3]\n')


# -- 2. env-local algorithm tables ------------------------------------------------------

ENV_TABLES = """
[[orchestrator.algorithms]]
id = "grpo"
options = {std_normalize = true}

[[orchestrator.train.env]]
id = "reverse-text"
[[orchestrator.train.env.algorithms]]
id = "grpo"
options = {std_normalize = true}

[[orchestrator.train.env]]
id = "alphabet-sort"
[[orchestrator.train.env.algorithms]]
id = "grpo"
[[orchestrator.train.env.algorithms]]
id = "rloo"
"""


def test_an_env_algorithm_table_becomes_a_run_level_entry_named_by_id(tmp_path: Path) -> None:
    """One `[[orchestrator.train.env.algorithms]]` table: a run-level entry (its own id, as
    no entry has it), the env's list naming it, one warning naming both keys."""
    text = '[[orchestrator.train.env]]\nid = "reverse-text"\n'
    text += '[[orchestrator.train.env.algorithms]]\nid = "rloo"\nname = "rloo"\n'
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load(tmp_path, text)
    warned_once(record, f"{ENV0}.algorithms.0", f"{ORCH}.algorithms.0")
    # No run-level list: the run's algorithms are the ones its envs name.
    assert [(a.id, a.name) for a in cfg.orchestrator.algorithms] == [("rloo", "rloo")]
    assert cfg.orchestrator.train.env[0].algorithms == ["rloo"]


def test_env_algorithm_ids_reuse_an_identical_entry_and_derive_one_otherwise(
    tmp_path: Path,
) -> None:
    """An env's table identical to a run-level entry reuses its id; one that differs
    (grpo without std_normalize) gets `<env key>-<id>`, the next `-2`; the result is the
    same every load, and routes each env to its own algorithm."""
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load(tmp_path, ENV_TABLES)
    assert len(record) == 3
    o = cfg.orchestrator
    assert [(a.id, a.name, a.options) for a in o.algorithms] == [
        ("grpo", "grpo", {"std_normalize": True}),
        ("alphabet-sort-grpo", "grpo", {}),
        ("rloo", "rloo", {}),
    ]
    assert [e.algorithms for e in o.train.env] == [["grpo"], ["alphabet-sort-grpo", "rloo"]]
    assert o.routed_envs("grpo") == {"reverse-text"}
    assert o.routed_envs("alphabet-sort-grpo") == {"alphabet-sort"}
    taken = ENV_TABLES.replace(
        '[[orchestrator.train.env]]\nid = "reverse-text"',
        '[[orchestrator.algorithms]]\nid = "alphabet-sort-grpo"\nname = "rloo"\n\n'
        '[[orchestrator.train.env]]\nid = "reverse-text"',
        1,
    )
    with pytest.warns(ConfigDeprecationWarning):
        again = load(tmp_path, taken)
    assert again.orchestrator.train.env[1].algorithms == ["alphabet-sort-grpo-2", "rloo"]
    with pytest.warns(ConfigDeprecationWarning):
        assert load(tmp_path, ENV_TABLES) == cfg


def test_env_algorithm_tables_in_an_override() -> None:
    """`orchestrator.train.env.0.algorithms=[{...}]` is read at load like the file's."""
    override = 'orchestrator.train.env.0.algorithms=[{id="grpo",options={std_normalize=false}}]'
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load_config("default", [override])
    warned_once(record, f"{ENV0}.algorithms.0", f"{ORCH}.algorithms.1")
    assert cfg.orchestrator.algorithms[1].id == "reverse-text-grpo"
    assert cfg.orchestrator.train.env[0].algorithms == ["reverse-text-grpo"]


@pytest.mark.parametrize(
    ("table", "env_id", "key"),
    [
        ('id = "grpo"\nshadow = true', "reverse-text", "algorithms.0.shadow"),
        ('name = "grpo"', "reverse-text", "algorithms.0.id"),
        ('id = "a.b"', "reverse-text", "algorithms.0.id"),
        ('id = "grpo"\noptions = 3', "reverse-text", "algorithms.0.options"),
        # A derived id must stay a subject token: "café-grpo" is not one.
        ('id = "grpo"\noptions = {std_normalize = false}', "café", "algorithms.0.id"),
    ],
)
def test_a_bad_env_algorithm_table_is_refused_naming_its_key(
    tmp_path: Path, table: str, env_id: str, key: str
) -> None:
    text = '[[orchestrator.algorithms]]\nid = "grpo"\noptions = {std_normalize = true}\n'
    text += f'[[orchestrator.train.env]]\nid = "{env_id}"\n'
    text += f"[[orchestrator.train.env.algorithms]]\n{table}\n"
    with pytest.raises(ConfigError, match=rf"`{ENV0}\.{key}`"):
        load(tmp_path, text)


def test_derived_ids_of_an_import_path_env_are_subject_tokens(tmp_path: Path) -> None:
    text = ENV_TABLES.replace('"alphabet-sort"', '"examples.my_env:make"')
    with pytest.warns(ConfigDeprecationWarning):
        cfg = load(tmp_path, text)
    assert cfg.orchestrator.algorithms[1].id == "examples-my_env-make-grpo"


# -- 3. the built-in algorithm id `rl` --------------------------------------------------


def test_rl_is_prime_rls_default_loss_grpo_without_std_normalisation(tmp_path: Path) -> None:
    """`rl` with no name runs `grpo` with its defaults (A = r - mean(r), no std division,
    prime-rl's default advantage); the worker `rlbus up` starts resolves; a name wins."""
    from roles.algorithm.registry import create
    from roles.up.preflight import algorithm_problems

    cfg = silently(lambda: load(tmp_path, '[orchestrator]\nalgorithms = ["rl"]\n'))
    (rl,) = cfg.orchestrator.algorithms
    assert (rl.id, rl.name, rl.options) == ("rl", "grpo", {})
    assert algorithm_problems(cfg) == []
    name, options = cfg.orchestrator.algorithm_spec("rl")
    algorithm = create(name, options)
    assert algorithm.from_rewards([1.0, 0.0, 0.0, 0.0]) == [0.75, -0.25, -0.25, -0.25]
    # An id absent from the config (an attached algorithm) is read the same way.
    assert OrchestratorConfig().algorithm_spec("rl") == ("grpo", {})
    named = resolve({ORCH: {"algorithms": [{"id": "rl", "name": "rloo"}]}})
    assert named.orchestrator.algorithms[0].name == "rloo"


# -- 4. env pools -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "old", "replicas", "pool"),
    [
        ('pool = {type = "static", num_workers = 3}', "pool", 3, (3, 3)),
        ('pool = {type = "elastic", max_workers = 5}', "pool", 1, (1, 5)),
        ('pool = {type = "elastic", min_workers = 2, max_workers = 5}', "pool", 2, (2, 5)),
        ("num_workers = 2", "num_workers", 2, (2, 2)),
        ('num_workers = "auto"', "num_workers", 1, (1, AUTO_MAX_REPLICAS)),
    ],
)
def test_a_train_env_pool_is_read_as_replicas(
    tmp_path: Path, line: str, old: str, replicas: int, pool: tuple[int, int]
) -> None:
    """In a file and as an override (of the key, or of the env's table), one warning."""
    text = f'[[orchestrator.train.env]]\nid = "reverse-text"\n{line}\n'
    key, _, value = line.partition(" = ")
    for load_it in (
        lambda: load(tmp_path, text),
        lambda: load_config("default", [f"{ENV0}.{key}={value}"]),
        lambda: load_config(
            "default", [f'orchestrator.train.env=[{{id="reverse-text",{key}={value}}}]']
        ),
    ):
        with pytest.warns(ConfigDeprecationWarning) as record:
            cfg = load_it()
        warned_once(record, f"{ENV0}.{old}", f"{ENV0}.replicas")
        (env,) = cfg.orchestrator.train.env
        assert (env.replicas, env.pool) == (replicas, pool)


def test_an_explicit_pool_wins_over_num_workers(tmp_path: Path) -> None:
    text = '[[orchestrator.train.env]]\nid = "reverse-text"\nnum_workers = 8\n'
    text += 'pool = {type = "static", num_workers = 2}\n'
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load(tmp_path, text)
    assert [str(r.message) for r in record][1] == (
        f"`{ENV0}.num_workers` is ignored: `{ENV0}.pool` is set"
    )
    assert cfg.orchestrator.train.env[0].pool == (2, 2)


@pytest.mark.parametrize(
    ("line", "key"),
    [
        ('pool = {type = "dynamic", num_workers = 2}', "pool.type"),
        ("pool = {num_workers = 2}", "pool.type"),
        ('pool = {type = "static"}', "pool.num_workers"),
        ('pool = {type = "static", num_workers = 0}', "pool.num_workers"),
        ('pool = {type = "static", max_workers = 2}', "pool.max_workers"),
        ('pool = {type = "elastic", max_workers = "4"}', "pool.max_workers"),
        ('pool = {type = "elastic", min_workers = 5, max_workers = 4}', "pool.min_workers"),
        ("pool = 3", "pool"),
        ("num_workers = 0", "num_workers"),
        ('num_workers = "many"', "num_workers"),
    ],
)
def test_a_bad_pool_is_refused_naming_its_key(tmp_path: Path, line: str, key: str) -> None:
    text = f'[[orchestrator.train.env]]\nid = "reverse-text"\n{line}\n'
    with pytest.raises(ConfigError, match=rf"`{ENV0}\.{key}`"):
        load(tmp_path, text)


@pytest.mark.parametrize("own", ["replicas = 2", "max_replicas = 2"])
def test_a_pool_and_rlbus_replicas_keys_together_are_refused_naming_both(
    tmp_path: Path, own: str
) -> None:
    text = '[[orchestrator.train.env]]\nid = "reverse-text"\nnum_workers = 2\n' + own + "\n"
    key = own.split()[0]
    with pytest.raises(ConfigError, match=rf"both `{ENV0}\.num_workers`.* and `{ENV0}\.{key}`"):
        load(tmp_path, text)


def test_an_eval_only_env_pool_is_read_as_its_replicas(tmp_path: Path) -> None:
    """An eval-only env's pool is static: `pool` / `num_workers` give its `replicas`; an
    elastic one is refused, and so is a pool on a train env's eval entry (its train pool
    serves its evals), naming the key the pool became."""
    where = "orchestrator.eval.env.0"
    text = '[[orchestrator.eval.env]]\nid = "alphabet-sort"\n'
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load(tmp_path, text + 'pool = {type = "static", num_workers = 2}\n')
    warned_once(record, f"{where}.pool", f"{where}.replicas")
    assert cfg.orchestrator.eval_only_envs()[0].pool == (2, 2)
    with pytest.warns(ConfigDeprecationWarning):
        cfg = load_config("smoke", ['orchestrator.eval.env=[{id="alphabet-sort",num_workers=3}]'])
    assert cfg.orchestrator.eval_only_envs()[0].servers == 3
    with pytest.raises(
        ConfigError, match=rf"`{where}\.pool\.type`: an eval-only env's pool is static"
    ):
        load(tmp_path, text + 'pool = {type = "elastic", max_workers = 2}\n')
    with pytest.raises(ConfigError, match=rf"`{where}\.num_workers`: an eval-only env's pool"):
        load(tmp_path, text + 'num_workers = "auto"\n')
    train = '[[orchestrator.eval.env]]\nid = "reverse-text"\nnum_workers = 2\n'
    with (
        pytest.warns(ConfigDeprecationWarning),
        pytest.raises(ConfigError, match=rf"`{where}\.replicas`: 'reverse-text' is a train env"),
    ):
        load(tmp_path, train)


# -- 5. [orchestrator.renderer] ------------------------------------------------------------


def test_the_orchestrator_renderer_is_model_renderer(tmp_path: Path) -> None:
    """`[orchestrator.renderer] name = "qwen3"` is `model.renderer`, in a file and in both
    override forms, and shows there in the resolved config (`rlbus up --dry-run`)."""
    text = '[orchestrator.renderer]\nname = "qwen3"\n'
    for load_it in (
        lambda: load(tmp_path, text),
        lambda: load_config("default", ["orchestrator.renderer.name=qwen3"]),
        lambda: load_config("default", ['orchestrator.renderer={name="qwen3"}']),
    ):
        with pytest.warns(ConfigDeprecationWarning) as record:
            cfg = load_it()
        warned_once(record, "orchestrator.renderer.name", "model.renderer")
        assert cfg.model.renderer == "qwen3"
        resolved = tomllib.loads(dump_toml(cfg))
        assert resolved["model"]["renderer"] == "qwen3" and "renderer" not in resolved[ORCH]


def test_a_renderer_given_twice_or_with_other_keys_is_refused(tmp_path: Path) -> None:
    text = '[model]\nrenderer = "auto"\n[orchestrator.renderer]\nname = "qwen3"\n'
    with pytest.raises(
        ConfigError, match=r"both `orchestrator\.renderer\.name`.* `model\.renderer`"
    ):
        load(tmp_path, text)
    with pytest.raises(ConfigError, match=r"unknown key `orchestrator\.renderer\.style`"):
        load(tmp_path, '[orchestrator.renderer]\nname = "qwen3"\nstyle = "x"\n')
    with pytest.raises(ConfigError, match=r"unknown key `orchestrator\.renderer\.style`"):
        load_config("default", ['orchestrator.renderer={name="qwen3",style="x"}'])


def test_a_translated_renderer_reaches_the_preflight_check(tmp_path: Path) -> None:
    """The renderer named in `[orchestrator.renderer]` is the one `rlbus up` checks against
    the model's tokenizer before any role starts (tests/integration/test_preflight.py
    covers the check itself on real templates)."""
    from roles.up.preflight import template_problems

    with pytest.warns(ConfigDeprecationWarning):
        cfg = load_config("smoke", ["orchestrator.renderer.name=no-such-renderer"])
    (problem,) = template_problems(cfg)
    assert problem.startswith("`model.renderer` ('no-such-renderer'): unknown renderer")


# -- 6. the reserved model key `policy` ---------------------------------------------------


def test_a_models_table_named_policy_is_refused(tmp_path: Path) -> None:
    """`[orchestrator.models.policy]` would be a second inference pool under the name of
    the model being trained; it is refused naming the key."""
    with pytest.raises(ConfigError, match=r"`orchestrator\.models\.policy`: 'policy' is the model"):
        load(tmp_path, '[orchestrator.models.policy]\nkind = "reference"\n')


# -- 7. an orchestrator section validated on its own ----------------------------------


def test_an_orchestrator_section_alone_translates_with_the_same_warnings() -> None:
    """`OrchestratorConfig.model_validate` of a dict rooted at `[orchestrator]` reads old
    and prime-rl spellings as a whole file does, warning once per rewrite."""
    section = {
        "sampling": {"max_tokens": 7},
        "env": [{"id": "reverse-text", "num_workers": 2}],
        "eval": {"envs": ["reverse-text"]},
        "algorithms": ["rl"],
    }
    with pytest.warns(ConfigDeprecationWarning) as alone:
        o = OrchestratorConfig.model_validate(section)
    with pytest.warns(ConfigDeprecationWarning) as whole:
        cfg = resolve({ORCH: section})
    assert [str(r.message) for r in alone] == [str(r.message) for r in whole]
    assert len(alone) == 5  # sampling, env, max_tokens, eval.envs, num_workers
    assert o == cfg.orchestrator
    assert (o.train.sampling.max_completion_tokens, o.train.env[0].pool) == (7, (2, 2))
    assert [e.id for e in o.eval.env] == ["reverse-text"]
    assert (o.algorithms[0].id, o.algorithms[0].name) == ("rl", "grpo")
    with pytest.raises(
        ValueError, match=r"`orchestrator\.renderer\.name` is rlbus's `model\.renderer`"
    ):
        OrchestratorConfig.model_validate({"renderer": {"name": "qwen3"}})


def test_a_file_warns_once_per_rewrite_and_its_resolved_form_reloads_silently(
    tmp_path: Path,
) -> None:
    """A whole file is translated once (not again by OrchestratorConfig): one warning per
    rewrite. What `rlbus up --dry-run` prints loads back equal, with no warning."""
    text = '[orchestrator.sampling]\nmax_tokens = 7\n[orchestrator.renderer]\nname = "qwen3"\n'
    text += '[[orchestrator.train.env]]\nid = "reverse-text"\nnum_workers = "auto"\n'
    text += '[[orchestrator.train.env.algorithms]]\nid = "rl"\n'
    with pytest.warns(ConfigDeprecationWarning) as record:
        cfg = load(tmp_path, text)
    assert len(record) == 5  # renderer, sampling, max_tokens, num_workers, env algorithm
    resolved = tmp_path / "resolved.toml"
    resolved.write_text(dump_toml(cfg))
    assert silently(lambda: load_config(resolved)) == cfg
    assert silently(lambda: RunConfig.model_validate(cfg.model_dump())) == cfg
