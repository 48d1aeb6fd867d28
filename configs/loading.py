"""Turn a TOML file or preset plus `key=value` overrides into a validated RunConfig.

    cfg = load_config("smoke", ["trainer.lr=1e-4", "orchestrator.train.env.0.group_size=2"])

Steps, each a small function: read the TOML (`read_raw`), translate deprecated and
prime-rl spellings in the file and in each override (`configs.deprecations`), apply
overrides (`apply_overrides`), validate (`resolve`). Every failure is a `ConfigError` whose message names the file and the
full dotted path of each bad key, because bad config must fail at start, readably.
"""

from __future__ import annotations

import copy
import difflib
import tomllib
import types
import warnings
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from configs.deprecations import TRANSLATED, dotted, translate_deprecated, translate_override
from configs.errors import ConfigDeprecationWarning, ConfigError
from configs.models import RunConfig
from configs.toml_emit import toml_value

DEFAULT_PRESET = "default"


def _presets_dir() -> Any:
    # importlib.resources works both from a checkout and from an installed wheel.
    return resources.files("configs") / "presets"


def list_presets() -> list[str]:
    """Names of the bundled presets (`configs/presets/<name>.toml`)."""
    return sorted(
        p.name.removesuffix(".toml") for p in _presets_dir().iterdir() if p.name.endswith(".toml")
    )


def read_raw(path: str | Path | None = None) -> tuple[str, dict[str, Any]]:
    """(label naming the source file, parsed TOML) for a file path or a preset name."""
    path = DEFAULT_PRESET if path is None else path
    # A bare name (no separator, no suffix) means a preset; anything else is a file path.
    if isinstance(path, str) and not any(c in path for c in "/\\.") and path in list_presets():
        source = _presets_dir() / f"{path}.toml"
    else:
        source = Path(path)
        if not source.is_file():
            raise ConfigError(
                f"config file not found: {str(path)!r} (not a file, and not a preset: "
                f"{', '.join(list_presets())})"
            )
    label = str(source)
    try:
        return label, tomllib.loads(source.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:  # its message carries "(at line L, column C)"
        raise ConfigError(f"{label}: invalid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{label}: not UTF-8 text: {e}") from None


def parse_value(text: str) -> Any:
    """An override value: a TOML value when it parses as one, else the plain string.

    `1e-4` -> float, `true` -> bool, `[1, 2]` -> list, `"x"` -> "x", `nats://h:1` -> str.
    """
    if "\n" in text:
        return text
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """`"a.b.0.c=3"` -> (["a", "b", "0", "c"], 3)."""
    key, sep, text = item.partition("=")
    keys = key.strip().split(".")
    if not sep or not all(k.strip() for k in keys):
        raise ConfigError(f"override {item!r} must look like `dotted.key=value`")
    return [k.strip() for k in keys], parse_value(text.strip())


def translate_overrides(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """Overrides with deprecated keys rewritten, and one message per rewrite."""
    out: list[str] = []
    messages: list[str] = []
    for item in overrides:
        keys, value = parse_override(item)  # validates the shape
        items, msgs = translate_override(tuple(keys), value)
        messages += msgs
        for path, new_value in items:
            # The value's own text when it is unchanged (only its key moved, or nothing).
            text = item.partition("=")[2] if new_value == value else toml_value(new_value)
            out.append(f"{dotted(path)}={text}")
    return out, messages


def _step(node: Any, key: str, path: list[str], nxt: str | None) -> Any:
    """Descend one key (a list index when `node` is a list); create missing tables."""
    where = ".".join(path)
    if isinstance(node, list):
        if not key.isdigit():
            raise ConfigError(f"`{where}`: `{'.'.join(path[:-1])}` is a list; index it by number")
        index = int(key)
        if index > len(node):
            raise ConfigError(
                f"`{where}`: index out of range (the list has {len(node)} "
                f"entries; use {len(node)} to append one)"
            )
        if index == len(node):
            node.append(None if nxt is None else [] if nxt.isdigit() else {})
        return node, index
    if not isinstance(node, dict):
        raise ConfigError(f"`{'.'.join(path[:-1])}` is a value, not a table; cannot set `{where}`")
    if nxt is not None and key not in node:
        node[key] = [] if nxt.isdigit() else {}
    return node, key


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """A copy of `raw` with each `dotted.key=value` override set, in order.

    A value that is a table or a list of tables keeps what it does not name (`_merged`):
    `orchestrator.train.env=[{id="reverse-text",max_replicas=3}]` changes one key of the
    preset's env and keeps its filters and group_size.
    """
    root = copy.deepcopy(raw)
    for item in overrides:
        keys, value = parse_override(item)
        node: Any = root
        for i, key in enumerate(keys):
            nxt = keys[i + 1] if i + 1 < len(keys) else None
            parent, slot = _step(node, key, keys[: i + 1], nxt)
            if nxt is None:
                old = parent[slot] if isinstance(parent, list) else parent.get(slot)
                parent[slot] = _merged(old, value, _type_at(keys))
            else:
                node = parent[slot]
    return root


def _merged(old: Any, new: Any, tp: Any) -> Any:
    """`new` set where `old` was, `tp` the schema's type there (None: not in the schema).

    The rule, so that an override keeps what it does not name (docs/configuration.md,
    "Overrides"):
    - a config table (a pydantic section, e.g. `trainer`) merges key by key, recursively;
    - a list of tables with an `id` (`orchestrator.train.env`, `orchestrator.eval.env`,
      `orchestrator.algorithms`) and a table of named tables (`orchestrator.models`,
      `cpus.roles`) name their entries: each given entry merges into the existing one of the same id (or
      key), a new id is added, and an entry not given is dropped (the list written is
      the list wanted);
    - anything else is replaced: values, lists of values, tables without an identity
      (`filters`), and free-form tables (`args`, `options`), which may mean "exactly this".
    """
    tp = _unwrap(tp)
    if isinstance(new, dict) and isinstance(old, dict):
        if _is_section(tp):
            fields = tp.model_fields
            out = dict(old)
            for key, value in new.items():
                field = fields.get(key)
                out[key] = _merged(old.get(key), value, field.annotation if field else None)
            return out
        if get_origin(tp) is dict and _is_section(entry := _unwrap(get_args(tp)[-1])):
            return {key: _merged(old.get(key), value, entry) for key, value in new.items()}
    if isinstance(new, list) and isinstance(old, list) and get_origin(tp) is list:
        entry = _unwrap(get_args(tp)[0])
        if _is_section(entry) and "id" in entry.model_fields:
            by_id = {_id(e): e for e in old if _id(e) is not None}
            return [_merged(by_id.get(_id(e)), e, entry) if isinstance(e, dict) else e for e in new]
    return new


def _id(entry: Any) -> str | None:
    """An entry's identity: its `id` when that is a string (anything else fails validation)."""
    ident = entry.get("id") if isinstance(entry, dict) else None
    return ident if isinstance(ident, str) else None


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _unwrap(tp: Any) -> Any:
    """`X` for `X | None` and `Annotated[X, ...]`; None for a union of several types."""
    if get_origin(tp) is Annotated:
        tp = get_args(tp)[0]
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        return _unwrap(args[0]) if len(args) == 1 else None
    return tp


def _type_at(loc: Sequence[Any]) -> Any:
    """The schema's type at `loc` (keys and list indexes) under RunConfig; None where the
    schema says nothing (an unknown key, or inside a free-form table)."""
    tp: Any = RunConfig
    for step in loc:
        tp = _unwrap(tp)
        if _is_section(tp):
            field = tp.model_fields.get(str(step))
            tp = field.annotation if field else None
        elif get_origin(tp) in (list, dict):
            tp = get_args(tp)[-1]
        else:
            return None
    return tp


def _fields_at(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the model at `loc` under RunConfig (for "did you mean")."""
    tp = _unwrap(_type_at(loc))
    return list(tp.model_fields) if _is_section(tp) else []


def describe_error(err: Any) -> str:
    """One line for one pydantic error, naming the key by its full dotted path."""
    loc = tuple(err["loc"])
    path = dotted(loc)
    if err["type"] == "extra_forbidden":
        close = difflib.get_close_matches(str(loc[-1]), _fields_at(loc[:-1]), n=1)
        hint = f" (did you mean `{dotted((*loc[:-1], close[0]))}`?)" if close else ""
        return f"unknown key `{path}`{hint}"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not loc or (err["type"] == "value_error" and "`" in msg):
        return msg  # our own cross-field messages already name their keys
    value = err.get("input")
    got = "" if err["type"] == "missing" or isinstance(value, dict | list) else f" (got {value!r})"
    return f"`{path}`: {msg}{got}"


def format_validation_error(e: ValidationError, source: str | None = None) -> str:
    """One line for one problem (the usual typo, read at a glance); a list for several."""
    where = f" ({source})" if source else ""
    problems = [describe_error(err) for err in e.errors()]
    if len(problems) == 1:
        return f"invalid config{where}: {problems[0]}"
    return f"invalid config{where}:\n" + "\n".join(f"  - {p}" for p in problems)


def _resolve(raw: Any, source: str | None, stacklevel: int) -> RunConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"config must be a table, got {type(raw).__name__}")
    translated, messages = translate_deprecated(raw)
    for msg in messages:
        warnings.warn(msg, ConfigDeprecationWarning, stacklevel=stacklevel)
    try:
        # Translated above: OrchestratorConfig need not translate its section again.
        return RunConfig.model_validate(translated, context={TRANSLATED: True})
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, source)) from None


def resolve(raw: dict[str, Any], *, source: str | None = None) -> RunConfig:
    """Translate deprecated spellings (warning once for each), then validate."""
    return _resolve(raw, source, stacklevel=3)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a preset name (`"default"`, `"smoke"`) or TOML file, apply overrides, validate.

    `path=None` loads the default preset. Deprecated spellings in the file and in
    override keys are both translated before the overrides apply, so an old run script
    (`orchestrator.sampling.max_tokens=64`) works against a new preset.
    """
    if isinstance(overrides, str):  # a lone "k=v" would otherwise iterate by character
        overrides = [overrides]
    source, raw = read_raw(path)
    raw, messages = translate_deprecated(raw)
    overrides, override_messages = translate_overrides(overrides)
    for msg in messages + override_messages:
        warnings.warn(msg, ConfigDeprecationWarning, stacklevel=2)
    label = f"{source} + {len(overrides)} override(s)" if overrides else source
    return _resolve(apply_overrides(raw, overrides), label, stacklevel=3)
