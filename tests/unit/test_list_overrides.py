"""An override that sets a table, or a list of tables with ids, keeps what it does not name.

The rule (configs/loading.py `_merged`, docs/configuration.md "Overrides"): config tables
merge key by key; lists of tables with an `id` and tables of named tables merge each
given entry into the one of the same id, add new ids and drop entries not given;
everything else (values, lists of values, `filters`, free-form `args` / `options`) is
replaced.
"""

from __future__ import annotations

from typing import Any

import pytest

from configs import ConfigError, apply_overrides, load_config


def test_a_named_env_keeps_the_presets_keys_it_does_not_set() -> None:
    """The README's pool line: only the pool changes; filters, group_size, sft stay."""
    for preset in ("default", "smoke", "tools"):
        (own,) = load_config(preset).orchestrator.train.env
        pool = f'orchestrator.train.env=[{{id="{own.id}",max_replicas=3}}]'
        (env,) = load_config(preset, [pool]).orchestrator.train.env
        assert env.max_replicas == 3, preset
        assert env.model_dump(exclude={"max_replicas"}) == own.model_dump(
            exclude={"max_replicas"}
        ), preset
    assert load_config("tools").orchestrator.train.env[0].args  # a table to lose


def test_a_new_id_is_added_and_an_entry_not_given_is_dropped() -> None:
    """The list written is the list run: its entries in its order, named ones merged."""
    cfg = load_config(
        "default", ['orchestrator.train.env=[{id="alphabet-sort"},{id="reverse-text",ratio=2}]']
    )
    sort, reverse = cfg.orchestrator.train.env
    assert (sort.id, sort.group_size, sort.filters) == ("alphabet-sort", 8, [])
    assert (reverse.id, reverse.ratio, len(reverse.filters)) == ("reverse-text", 2.0, 3)
    (only,) = load_config("default", ['orchestrator.train.env=[{id="alphabet-sort"}]']).orchestrator.train.env  # fmt: skip
    assert only.id == "alphabet-sort" and only.filters == []


def test_algorithms_merge_by_id_and_free_form_options_are_replaced() -> None:
    """`options` is the algorithm's own table: what is given is all of it."""
    kept = load_config("default", ['orchestrator.algorithms=[{id="grpo",shadow=true},{id="rloo"}]'])
    grpo, rloo = kept.orchestrator.algorithms
    assert (grpo.shadow, grpo.options) == (True, {"std_normalize": True})
    assert (rloo.id, rloo.name) == ("rloo", "rloo")
    cleared = load_config("default", ['orchestrator.algorithms=[{id="grpo",options={}}]'])
    assert cleared.orchestrator.algorithms[0].options == {}


def test_a_list_without_ids_is_replaced() -> None:
    """Filters have no id: the list given is the filters run, each with library defaults."""
    cfg = load_config("default", ['orchestrator.train.env.0.filters=[{type="length"}]'])
    (length,) = cfg.orchestrator.train.env[0].filters
    assert (length.type, length.enforce, length.options) == ("length", True, {})


def test_a_config_table_merges_into_the_presets() -> None:
    """`trainer={lr=...}` changes lr; the preset's other trainer keys stay."""
    smoke = load_config("smoke")
    cfg = load_config("smoke", ["trainer={lr=0.5}", "orchestrator.train.env.0.sampling={top_k=3}"])
    assert (cfg.trainer.lr, cfg.trainer.seq_len) == (0.5, smoke.trainer.seq_len)
    assert cfg.trainer.seq_len != load_config("default").trainer.seq_len  # the preset's own
    sampling = cfg.orchestrator.train.env[0].sampling
    assert sampling is not None and (sampling.top_k, sampling.max_completion_tokens) == (3, 16)


def test_named_models_merge_by_key_and_unnamed_ones_are_dropped() -> None:
    raw = {"orchestrator": {"models": {"teacher": {"kind": "teacher", "subject_model": "t"},
                                       "old": {"kind": "reference"}}}}  # fmt: skip
    out = apply_overrides(raw, ['orchestrator.models={teacher={path="x"}, ref={kind="reference"}}'])
    assert out["orchestrator"]["models"] == {
        "teacher": {"kind": "teacher", "subject_model": "t", "path": "x"},
        "ref": {"kind": "reference"},
    }


def test_values_lists_of_values_and_unknown_tables_are_replaced() -> None:
    """Only the schema's config tables merge: a free-form or unknown table is the value."""
    raw: dict[str, Any] = {
        "trainer": {"betas": [0.9, 0.999]},
        "orchestrator": {"train": {"env": [{"id": "e", "args": {"a": 1, "b": 2}}]}},
        "unknown": {"a": 1},
    }
    out = apply_overrides(
        raw,
        ["trainer.betas=[0.5, 0.6]", "orchestrator.train.env.0.args={b=3}", "unknown={c=1}"],
    )
    assert out["trainer"]["betas"] == [0.5, 0.6]
    assert out["orchestrator"]["train"]["env"][0]["args"] == {"b": 3}
    assert out["unknown"] == {"c": 1}
    assert raw["orchestrator"]["train"]["env"][0]["args"] == {"a": 1, "b": 2}  # not mutated


def test_an_indexed_entry_set_as_a_table_merges_too() -> None:
    """`env.0={...}` is the same rule as the whole list: the entry keeps what it does not set."""
    (env,) = load_config("default", ["orchestrator.train.env.0={id='reverse-text',ratio=3}"]).orchestrator.train.env  # fmt: skip
    assert (env.ratio, env.group_size, len(env.filters)) == (3.0, 8, 3)


def test_the_eval_env_list_merges_by_id() -> None:
    raw = {"orchestrator": {"eval": {"env": [{"id": "reverse-text", "num_tasks": 2}]}}}
    out = apply_overrides(raw, ['orchestrator.eval.env=[{id="reverse-text",max_turns=2},{id="x"}]'])
    assert out["orchestrator"]["eval"]["env"] == [
        {"id": "reverse-text", "num_tasks": 2, "max_turns": 2},
        {"id": "x"},
    ]


def test_an_entry_without_a_string_id_is_left_to_validation() -> None:
    """Not an identity, so nothing to merge with: the usual one line naming the key."""
    with pytest.raises(ConfigError, match=r"`orchestrator\.train\.env\.0\.id`"):
        load_config("default", ["orchestrator.train.env=[{id=[1]}]"])
    with pytest.raises(ConfigError, match=r"`orchestrator\.train\.env\.0\.id`"):
        load_config("default", ["orchestrator.train.env=[{group_size=2}]"])
