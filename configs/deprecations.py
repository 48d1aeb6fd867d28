"""Old config spellings, translated to current ones before validation.

A rename must never break a user's TOML on the day it lands: the old key keeps
working, each use of it warns once naming the old and the new path, and giving both
spellings is an error (we would otherwise have to guess which one the user meant).
`translate_deprecated` is pure: it returns a new dict and the warning messages, and
the caller decides how to warn.

To add a rename, append to `MOVED_TABLES` or `RENAMED_SAMPLING_KEYS` (a list of names
that became a list of tables: `TABLED_LISTS`); a key that is
gone goes to `REMOVED_KEYS` (or, in every `[orchestrator.models.<key>]`, to
`REMOVED_MODEL_KEYS`): dropped with a warning that says why, in a file or an override.
"""

from __future__ import annotations

import copy
from typing import Any

from configs.errors import ConfigError

Path = tuple[str | int, ...]

# Whole tables that moved: (old path, new path).
MOVED_TABLES: tuple[tuple[Path, Path], ...] = (
    (("orchestrator", "sampling"), ("orchestrator", "train", "sampling")),
    (("orchestrator", "env"), ("orchestrator", "train", "env")),
)

# Keys removed from every `[orchestrator.models.<key>]` table: key -> why.
REMOVED_MODEL_KEYS: dict[str, str] = {
    "tokens": "every model answers with token ids and logprobs; the key never did anything",
}

# Keys removed at one path: path -> why.
REMOVED_KEYS: dict[Path, str] = {
    ("inference", "continuous_batching"): (
        "the torch engine always admits requests into its running decode loop between "
        "steps (roles/inference/engine.py); there is no static mode left to choose"
    ),
}

# Lists of names that became lists of tables, each name under one key: old path ->
# (new path, the key). `[orchestrator.eval] envs = ["a"]` is `[[orchestrator.eval.env]]
# id = "a"`: an eval env entry has more to say than its id (configs/orchestrator.py).
TABLED_LISTS: dict[Path, tuple[Path, str]] = {
    ("orchestrator", "eval", "envs"): (("orchestrator", "eval", "env"), "id"),
}

# Keys renamed inside every sampling table (train, per-env, eval): old -> new.
RENAMED_SAMPLING_KEYS: dict[str, str] = {"max_tokens": "max_completion_tokens"}


def dotted(path: Path) -> str:
    """`("orchestrator", "train", "env", 0)` -> `"orchestrator.train.env.0"`."""
    return ".".join(str(p) for p in path)


def deprecation_message(old: Path, new: Path) -> str:
    return f"`{dotted(old)}` is deprecated; use `{dotted(new)}`"


def _lookup(root: Any, path: Path) -> Any:
    """The value at `path`, or None when any step is missing or of the wrong kind."""
    node = root
    for step in path:
        if isinstance(step, int):
            if not isinstance(node, list) or step >= len(node):
                return None
        elif not isinstance(node, dict) or step not in node:
            return None
        node = node[step]
    return node


def _table_for(root: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The dict at `path`, creating missing tables; None if something else is in the way."""
    node: Any = root
    for step in path:
        if isinstance(step, int):
            node = _lookup(node, (step,))
        elif isinstance(node, dict):
            node = node.setdefault(step, {})
        else:
            return None
    return node if isinstance(node, dict) else None


def _move(root: dict[str, Any], old: Path, new: Path) -> str | None:
    """Move the value at `old` to `new` (both end in a key); the warning, or None."""
    old_parent = _lookup(root, old[:-1])
    old_key, new_key = old[-1], new[-1]
    if not isinstance(old_parent, dict) or old_key not in old_parent:
        return None
    if _lookup(root, new) is not None:
        raise ConfigError(
            f"both `{dotted(old)}` (deprecated) and `{dotted(new)}` are set; "
            f"keep only `{dotted(new)}`"
        )
    new_parent = _table_for(root, new[:-1])
    if new_parent is None:
        return None  # something odd is in the way; validation will name it
    new_parent[str(new_key)] = old_parent.pop(str(old_key))
    return deprecation_message(old, new)


def _sampling_tables(root: dict[str, Any]) -> list[Path]:
    """Paths of every sampling table that may hold renamed keys."""
    paths: list[Path] = [
        ("orchestrator", "train", "sampling"),
        ("orchestrator", "eval", "sampling"),
    ]
    envs = _lookup(root, ("orchestrator", "train", "env"))
    if isinstance(envs, list):
        paths += [("orchestrator", "train", "env", i, "sampling") for i in range(len(envs))]
    return paths


def _is_sampling_table(path: Path) -> bool:
    p = tuple(str(x) for x in path)
    return p in {("orchestrator", "train", "sampling"), ("orchestrator", "eval", "sampling")} or (
        len(p) == 5
        and p[:3] == ("orchestrator", "train", "env")
        and p[3].isdigit()
        and p[4] == "sampling"
    )


def removed_message(path: Path, why: str) -> str:
    return f"`{dotted(path)}` is removed and ignored: {why}"


def removed_key(path: Path) -> str | None:
    """The warning for an override of a removed key (to be dropped), else None."""
    why = REMOVED_KEYS.get(tuple(str(p) for p in path))
    return removed_message(path, why) if why else None


def tabled(value: Any, key: str) -> Any:
    """A list of names as the list of tables it became (anything else as it is, for
    validation to name)."""
    if isinstance(value, list):
        return [{key: x} for x in value]
    return value


def translate_tabled(path: Path, value: Any) -> tuple[Path, Any, str] | None:
    """An override of a `TABLED_LISTS` key (the list, or one element by index) as
    (new path, new value, message); None for any other key."""
    p = tuple(str(x) for x in path)
    for old, (new, key) in TABLED_LISTS.items():
        if p == old:
            return new, tabled(value, key), deprecation_message(old, new)
        if len(p) == len(old) + 1 and p[:-1] == old and p[-1].isdigit():
            return (*new, p[-1], key), value, deprecation_message(old, new)
    return None


def translate_key(path: Path) -> tuple[Path, list[str]]:
    """Rewrite one dotted key path (an override's key); return (new path, messages).

    `orchestrator.sampling.max_tokens` -> `orchestrator.train.sampling.max_completion_tokens`.
    """
    messages: list[str] = []
    for old, new in MOVED_TABLES:
        if path[: len(old)] == old:
            messages.append(deprecation_message(old, new))
            path = (*new, *path[len(old) :])
    if path and _is_sampling_table(path[:-1]) and str(path[-1]) in RENAMED_SAMPLING_KEYS:
        new_path = (*path[:-1], RENAMED_SAMPLING_KEYS[str(path[-1])])
        messages.append(deprecation_message(path, new_path))
        path = new_path
    return path, messages


def translate_deprecated(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Rewrite old spellings in a raw config dict; return (new dict, one message per rewrite).

    Raises ConfigError when an old and a new spelling of the same key are both set.
    """
    root = copy.deepcopy(raw)
    messages: list[str] = []
    for old, new in MOVED_TABLES:
        if msg := _move(root, old, new):
            messages.append(msg)
    # After the moves, so `[orchestrator.sampling] max_tokens` is found at its new home.
    for table in _sampling_tables(root):
        for old_key, new_key in RENAMED_SAMPLING_KEYS.items():
            if msg := _move(root, (*table, old_key), (*table, new_key)):
                messages.append(msg)
    for old, (new, key) in TABLED_LISTS.items():
        parent = _lookup(root, old[:-1])
        if isinstance(parent, dict) and old[-1] in parent:
            parent[str(old[-1])] = tabled(parent[str(old[-1])], key)
            if msg := _move(root, old, new):
                messages.append(msg)
    for path, why in REMOVED_KEYS.items():
        parent = _lookup(root, path[:-1])
        if isinstance(parent, dict) and path[-1] in parent:
            parent.pop(str(path[-1]))
            messages.append(removed_message(path, why))
    models = _lookup(root, ("orchestrator", "models"))
    for key, table in (models or {}).items() if isinstance(models, dict) else ():
        for old_key, why in REMOVED_MODEL_KEYS.items():
            if isinstance(table, dict) and old_key in table:
                table.pop(old_key)
                messages.append(removed_message(("orchestrator", "models", key, old_key), why))
    return root, messages
