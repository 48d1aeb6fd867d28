"""Old and prime-rl config spellings, translated to current ones before validation.

A rename must never break a user's TOML on the day it lands: the old key keeps
working, each use of it warns once naming the old and the new path, and giving both
spellings is an error (we would otherwise have to guess which one the user meant).
A prime-rl user's spellings are read the same way (docs/configuration.md, "prime-rl
spellings"): each warns once naming rlbus's key, except those that are an equal
spelling (`orchestrator.algorithms = ["grpo"]`, bare ids for tables), which do not warn.
Every function here is pure: it returns new values and the warning messages, and the
caller decides how to warn.

Three entry points, one set of rules:

- `translate_orchestrator(section)`: the rules under `[orchestrator]`, on a dict rooted
  at that section. `OrchestratorConfig` runs it before it validates, so a section
  validated on its own (`OrchestratorConfig.model_validate(...)`) reads old spellings.
- `translate_deprecated(raw)`: a whole config: the root-level rules (`REMOVED_KEYS`,
  `MOVED_KEYS`), then the same `[orchestrator]` rules. Validation of its result passes
  the context `{TRANSLATED: True}` so `OrchestratorConfig` does not run them again.
- `translate_override(path, value)`: one `key=value` override, before it is applied,
  so that it lands where the current spelling would (and merges as that would).

To add a rename, append to `MOVED_TABLES` or `RENAMED_SAMPLING_KEYS` (a list of names
that became a list of tables: `TABLED_LISTS`; one key that moved to another section:
`MOVED_KEYS`); a key that is gone goes to `REMOVED_KEYS` (or, in every
`[orchestrator.models.<key>]`, to `REMOVED_MODEL_KEYS`): dropped with a warning that
says why, in a file or an override. A rule that rewrites one kind of node wherever it
is (every train env, the algorithm list) is a function in `NODE_RULES`, with the
node's path pattern and the keys that trigger it: files and overrides both apply it.
A rule across nodes (`_env_algorithms`) runs once on the translated section.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

from configs.errors import ConfigError
from configs.orchestrator import algorithm_name, env_key, is_token

Path = tuple[str | int, ...]

# Validation context key: this dict was translated already (`translate_deprecated`).
TRANSLATED = "rlbus.translated"

# Stands for any list index in a `NODE_RULES` pattern.
ANY = "*"

# Whole tables that moved: (old path, new path).
MOVED_TABLES: tuple[tuple[Path, Path], ...] = (
    (("orchestrator", "sampling"), ("orchestrator", "train", "sampling")),
    (("orchestrator", "env"), ("orchestrator", "train", "env")),
)

# One key that lives in another section in rlbus: old path -> new path. prime-rl's
# `[orchestrator.renderer] name = "qwen3"` is the policy's renderer, `model.renderer`;
# the old key's table holds nothing else (anything else in it is refused).
MOVED_KEYS: dict[Path, Path] = {
    ("orchestrator", "renderer", "name"): ("model", "renderer"),
}

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

# prime-rl's `num_workers = "auto"`: an elastic env pool of 1 up to this many servers.
# A constant, not this machine's CPU count, so a config means the same on every machine
# (the resolved config is recorded and resumed elsewhere); the pool grows only under a
# backlog (`env_server.scale_up_backlog`).
AUTO_MAX_REPLICAS = 4


def dotted(path: Path) -> str:
    """`("orchestrator", "train", "env", 0)` -> `"orchestrator.train.env.0"`."""
    return ".".join(str(p) for p in path)


def deprecation_message(old: Path, new: Path) -> str:
    return f"`{dotted(old)}` is deprecated; use `{dotted(new)}`"


def spelling_message(old: Path, new: Path, detail: str = "") -> str:
    """The warning for a prime-rl spelling read as rlbus's `new` key."""
    return f"`{dotted(old)}` is prime-rl's spelling; rlbus reads it as `{dotted(new)}`{detail}"


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


def _move(root: dict[str, Any], old: Path, new: Path, prime_rl: bool = False) -> str | None:
    """Move the value at `old` to `new` (both end in a key); the warning, or None."""
    old_parent = _lookup(root, old[:-1])
    old_key, new_key = old[-1], new[-1]
    if not isinstance(old_parent, dict) or old_key not in old_parent:
        return None
    if _lookup(root, new) is not None:
        kind = "prime-rl's spelling" if prime_rl else "deprecated"
        raise ConfigError(
            f"both `{dotted(old)}` ({kind}) and `{dotted(new)}` are set; keep only `{dotted(new)}`"
        )
    new_parent = _table_for(root, new[:-1])
    if new_parent is None:
        return None  # something odd is in the way; validation will name it
    new_parent[str(new_key)] = old_parent.pop(str(old_key))
    return spelling_message(old, new) if prime_rl else deprecation_message(old, new)


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


# -- node rules: one kind of node rewritten wherever it is, in a file or an override ----

NodeRule = Callable[[Any, Path], tuple[Any, list[str]]]


def _bare_ids(algorithms: Any, path: Path) -> tuple[Any, list[str]]:
    """`algorithms = ["grpo", {id = "rloo"}]`: a bare id is the table `{id = "grpo"}`.
    An equal spelling of the same thing: no warning."""
    if not isinstance(algorithms, list):
        return algorithms, []
    return [{"id": a} if isinstance(a, str) else a for a in algorithms], []


def _whole(value: Any, where: str, alternative: str = "") -> int:
    """`value` as a whole number >= 1, else a ConfigError naming `where`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"`{where}` = {value!r} must be a whole number >= 1{alternative}")
    return value


_STATIC = 'pool = {type = "static", num_workers = N}'
_ELASTIC = 'pool = {type = "elastic", max_workers = N} (optionally min_workers)'


def _pool_bounds(pool: Any, where: str) -> tuple[int, int]:
    """(min, max) servers of prime-rl's `pool` table at `where`."""
    if not isinstance(pool, dict):
        raise ConfigError(f"`{where}` must be a table: {_STATIC}, or {_ELASTIC}")
    kind = pool.get("type")
    takes = {"static": ("num_workers",), "elastic": ("max_workers", "min_workers")}
    if kind not in takes:
        raise ConfigError(f'`{where}.type` = {kind!r} must be "static" or "elastic"')
    for key in pool:
        if key != "type" and key not in takes[kind]:
            raise ConfigError(
                f"unknown key `{where}.{key}` (a {kind} pool takes "
                f"{' and '.join(f'`{k}`' for k in takes[kind])})"
            )
    first = takes[kind][0]
    if first not in pool:
        raise ConfigError(
            f"`{where}.{first}` is required: {_STATIC if kind == 'static' else _ELASTIC}"
        )
    high = _whole(pool[first], f"{where}.{first}")
    if kind == "static":
        return high, high
    low = _whole(pool.get("min_workers", 1), f"{where}.min_workers")
    if low > high:
        raise ConfigError(
            f"`{where}.min_workers` = {low} must not exceed `{where}.max_workers` = {high}"
        )
    return low, high


def _workers_bounds(num_workers: Any, where: str) -> tuple[int, int]:
    """(min, max) servers of prime-rl's `num_workers` at `where`: N, or "auto"."""
    if num_workers == "auto":
        return 1, AUTO_MAX_REPLICAS
    n = _whole(num_workers, where, ' or "auto"')
    return n, n


_POOL_SPELLINGS = ("pool", "num_workers")


def _pool(entry: Any, path: Path, elastic: bool) -> tuple[Any, list[str]]:
    """prime-rl's `pool` (or the older `num_workers`) on an env entry at `path`, read as
    rlbus's `replicas` (and, where the pool may be elastic, `min_replicas` and
    `max_replicas`). An explicit `pool` wins over `num_workers`, which is dropped."""
    if not isinstance(entry, dict) or not any(k in entry for k in _POOL_SPELLINGS):
        return entry, []
    own = ("replicas", "min_replicas", "max_replicas") if elastic else ("replicas",)
    given = next(k for k in _POOL_SPELLINGS if k in entry)
    if clash := [k for k in own if k in entry]:
        raise ConfigError(
            f"both `{dotted((*path, given))}` (prime-rl's spelling) and "
            f"`{dotted((*path, clash[0]))}` are set; keep only `{dotted((*path, clash[0]))}`"
        )
    entry = dict(entry)
    messages = []
    if "pool" in entry and "num_workers" in entry:
        entry.pop("num_workers")
        messages.append(
            f"`{dotted((*path, 'num_workers'))}` is ignored: `{dotted((*path, 'pool'))}` is set"
        )
    old = (*path, given)
    bounds = _pool_bounds if given == "pool" else _workers_bounds
    low, high = bounds(entry.pop(given), dotted(old))
    if not elastic and low != high:
        key = dotted((*old, "type")) if given == "pool" else dotted(old)
        raise ConfigError(
            f"`{key}`: an eval-only env's pool is static; give {_STATIC} (or num_workers = N)"
        )
    if elastic:
        # All three, so that a static pool stays static when an override merges it into
        # an env that had bounds of its own.
        entry.update(replicas=low, min_replicas=low, max_replicas=high)
        detail = f" = {low}, `min_replicas` = {low}, `max_replicas` = {high}"
    else:
        entry["replicas"] = low
        detail = f" = {low}"
    messages.insert(0, spelling_message(old, (*path, "replicas"), detail))
    return entry, messages


def _train_pool(entry: Any, path: Path) -> tuple[Any, list[str]]:
    return _pool(entry, path, elastic=True)


def _eval_pool(entry: Any, path: Path) -> tuple[Any, list[str]]:
    return _pool(entry, path, elastic=False)


# (path pattern, keys of the node that trigger the rule, the rule). An override of a
# trigger key inside a matching node (`orchestrator.train.env.0.pool=...`) is applied to
# the node as a table holding that key, so it lands as the node's current spelling would.
NODE_RULES: tuple[tuple[Path, tuple[str, ...], NodeRule], ...] = (
    (("orchestrator", "algorithms"), (), _bare_ids),
    (("orchestrator", "train", "env", ANY), _POOL_SPELLINGS, _train_pool),
    (("orchestrator", "eval", "env", ANY), _POOL_SPELLINGS, _eval_pool),
)


def _apply(node: Any, path: Path, rest: Path, rule: NodeRule, messages: list[str]) -> Any:
    """`node` (at `path`) with `rule` applied to each node `rest` below it leads to."""
    if not rest:
        new, msgs = rule(node, path)
        messages += msgs
        return new
    step, more = rest[0], rest[1:]
    if step == ANY and isinstance(node, list):
        return [_apply(x, (*path, i), more, rule, messages) for i, x in enumerate(node)]
    if step != ANY and isinstance(node, dict) and step in node:
        return {**node, step: _apply(node[step], (*path, step), more, rule, messages)}
    return node


def _matches(path: Path, pattern: Path) -> bool:
    return len(path) == len(pattern) and all(
        s == p or (p == ANY and str(s).isdigit()) for s, p in zip(path, pattern, strict=True)
    )


def _node_rules(path: Path, value: Any) -> tuple[Path, Any, list[str]]:
    """One override through `NODE_RULES`: (its path, its value, messages)."""
    messages: list[str] = []
    for pattern, triggers, rule in NODE_RULES:
        n = len(pattern)
        if len(path) <= n and _matches(path, pattern[: len(path)]):
            value = _apply(value, path, pattern[len(path) :], rule, messages)
        elif len(path) > n and _matches(path[:n], pattern) and path[n] in triggers:
            for step in reversed(path[n:]):  # `env.0.pool.type=x` -> `env.0={pool={type=x}}`
                value = {step: value}
            path = path[:n]
            value = _apply(value, path, (), rule, messages)
    return path, value, messages


# -- keys that moved to another section -------------------------------------------------


def _moved_leftover(old: Path, table: dict[str, Any]) -> None:
    """Refuse what else the table of a `MOVED_KEYS` key holds: rlbus reads only the key."""
    if table:
        raise ConfigError(
            f"unknown key `{dotted((*old[:-1], next(iter(table))))}` (rlbus reads only "
            f"`{dotted(old)}`, as `{dotted(MOVED_KEYS[old])}`)"
        )


def _move_keys(root: dict[str, Any]) -> list[str]:
    """`MOVED_KEYS` in a whole config, in place; the messages."""
    messages = []
    for old, new in MOVED_KEYS.items():
        if msg := _move(root, old, new, prime_rl=True):
            messages.append(msg)
        parent, holder = _lookup(root, old[:-1]), _lookup(root, old[:-2])
        if isinstance(parent, dict) and isinstance(holder, dict) and old[-1] not in parent:
            _moved_leftover(old, parent)
            holder.pop(str(old[-2]))  # the emptied table
    return messages


def _moved_key_override(path: Path, value: Any) -> tuple[Path, Any, str] | None:
    """An override of a `MOVED_KEYS` key, or of its table, as (new path, value, message)."""
    p = tuple(str(x) for x in path)
    for old, new in MOVED_KEYS.items():
        if p == old:
            return new, value, spelling_message(old, new)
        if p == old[:-1] and isinstance(value, dict) and old[-1] in value:
            _moved_leftover(old, {k: v for k, v in value.items() if k != old[-1]})
            return new, value[old[-1]], spelling_message(old, new)
    return None


# -- env-local algorithm tables: a rule across nodes (envs and the run's list) ----------

_ENV_ALGORITHM_KEYS = ("id", "name", "options")


def _env_algorithm(table: dict[str, Any], where: str) -> dict[str, Any]:
    """An env's algorithm table, checked: `id`, and optionally `name` and `options`."""
    for key in table:
        if key not in _ENV_ALGORITHM_KEYS:
            raise ConfigError(
                f"unknown key `{where}.{key}` (an algorithm table in an env takes "
                "`id`, `name` and `options`; other keys go in `[[orchestrator.algorithms]]`)"
            )
    ident, name, options = table.get("id"), table.get("name"), table.get("options", {})
    if not isinstance(ident, str) or not ident:
        raise ConfigError(f'`{where}.id` is required: the algorithm\'s id (e.g. "grpo")')
    if not is_token(ident):
        raise ConfigError(
            f"`{where}.id` = {ident!r} must use letters, digits, '-' and '_' only (it names subjects)"
        )
    if name is not None and not isinstance(name, str):
        raise ConfigError(f"`{where}.name` = {name!r} must be a registered algorithm's name")
    if not isinstance(options, dict):
        raise ConfigError(f"`{where}.options` must be a table")
    return table


def _same_algorithm(entry: Any, table: dict[str, Any]) -> bool:
    """Whether a run-level entry runs exactly what an env's table asks for."""
    return (
        isinstance(entry, dict)
        and not entry.get("shadow", False)
        and algorithm_name(entry["id"], entry.get("name"))
        == algorithm_name(table["id"], table.get("name"))
        and entry.get("options", {}) == table.get("options", {})
    )


def _run_level_id(run: list[Any], table: dict[str, Any], key: str) -> tuple[str, int]:
    """The run-level id for an env's algorithm table, adding an entry if none fits:
    (id, its index in `run`). Tried in order, the first free or identical one wins: the
    table's own id, then `<env key>-<id>`, then `<env key>-<id>-2`, `-3`, ..."""
    ident = table["id"]
    derived = (f"{key}-{ident}" + (f"-{n}" if n > 1 else "") for n in itertools.count(1))
    for candidate in itertools.chain([ident], derived):
        index = next(
            (i for i, e in enumerate(run) if isinstance(e, dict) and e.get("id") == candidate),
            None,
        )
        if index is None:
            # A derived id names its algorithm: the table's name, or its own id's.
            name = {} if candidate == ident else {"name": algorithm_name(ident, table.get("name"))}
            run.append({**table, "id": candidate, **name})
            return candidate, len(run) - 1
        if _same_algorithm(run[index], table):
            return candidate, index
    raise AssertionError("unreachable")  # itertools.count never ends


def _env_algorithms(root: dict[str, Any]) -> list[str]:
    """`[[orchestrator.train.env.algorithms]]` tables (`id`, `name`, `options`) become
    run-level `[[orchestrator.algorithms]]` entries, named by id in the env's list
    (`_run_level_id`). With no run-level list, the run's algorithms are those the envs
    name. In place; the messages."""
    section = root["orchestrator"]
    envs = _lookup(section, ("train", "env"))
    if not isinstance(envs, list):
        return []
    lists = [
        (i, env["algorithms"])
        for i, env in enumerate(envs)
        if isinstance(env, dict)
        and isinstance(env.get("id"), str)
        and isinstance(env.get("algorithms"), list)
        and any(isinstance(a, dict) for a in env["algorithms"])
    ]
    run = section.setdefault("algorithms", []) if lists else None
    if not isinstance(run, list):
        return []  # validation names what is there instead
    messages = []
    for i, names in lists:
        for j, table in enumerate(names):
            if not isinstance(table, dict):
                continue
            where = ("orchestrator", "train", "env", i, "algorithms", j)
            _env_algorithm(table, dotted(where))
            ident, k = _run_level_id(run, table, env_key(envs[i]["id"]))
            if not is_token(ident):
                raise ConfigError(
                    f"`{dotted(where)}.id`: the run-level id it needs, {ident!r}, must use "
                    "letters, digits, '-' and '_' only (give the env an id that does)"
                )
            names[j] = ident
            messages.append(
                spelling_message(
                    where,
                    ("orchestrator", "algorithms", k),
                    f" (id {ident!r}), named by its id in `{dotted(where[:-1])}`",
                )
            )
    return messages


# -- the entry points -----------------------------------------------------------------


def _translate_orchestrator(root: dict[str, Any]) -> list[str]:
    """The `[orchestrator]` rules on `root["orchestrator"]`, in place; the messages."""
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
    models = _lookup(root, ("orchestrator", "models"))
    for key, table in models.items() if isinstance(models, dict) else ():
        for old_key, why in REMOVED_MODEL_KEYS.items():
            if isinstance(table, dict) and old_key in table:
                table.pop(old_key)
                messages.append(removed_message(("orchestrator", "models", key, old_key), why))
    # After the moves and the eval envs' tabling: the rules find each node at its new home.
    for pattern, _, rule in NODE_RULES:
        root["orchestrator"] = _apply(
            root["orchestrator"], pattern[:1], pattern[1:], rule, messages
        )
    return messages + _env_algorithms(root)


def translate_orchestrator(section: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Rewrite old and prime-rl spellings in an `[orchestrator]` section (a dict rooted
    at it); return (new dict, one message per rewrite).

    Raises ConfigError when two spellings of one key are both set, when a spelling is
    malformed, and for a key that moved out of the section (`orchestrator.renderer`:
    only a whole config has `model.renderer` to put it in)."""
    for old, new in MOVED_KEYS.items():
        if old[0] == "orchestrator" and _lookup({"orchestrator": section}, old[:-1]) is not None:
            raise ConfigError(
                f"`{dotted(old)}` is rlbus's `{dotted(new)}`, outside `[orchestrator]`: "
                "set it in the whole config"
            )
    root = {"orchestrator": copy.deepcopy(section)}
    messages = _translate_orchestrator(root)
    return root["orchestrator"], messages


def translate_deprecated(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Rewrite old spellings in a raw config dict; return (new dict, one message per rewrite).

    Raises ConfigError when an old and a new spelling of the same key are both set.
    """
    root = copy.deepcopy(raw)
    messages = _move_keys(root)
    if isinstance(root.get("orchestrator"), dict):
        messages += _translate_orchestrator(root)
    for path, why in REMOVED_KEYS.items():
        parent = _lookup(root, path[:-1])
        if isinstance(parent, dict) and path[-1] in parent:
            parent.pop(str(path[-1]))
            messages.append(removed_message(path, why))
    return root, messages


def translate_override(path: Path, value: Any) -> tuple[list[tuple[Path, Any]], list[str]]:
    """One override (`path=value`) as the overrides to apply instead (none for a removed
    key), and one message per rewrite."""
    if gone := removed_key(path):
        return [], [gone]
    if (reshaped := translate_tabled(path, value)) is not None:
        new_path, value, msg = reshaped
        return [(new_path, value)], [msg]
    if (moved := _moved_key_override(path, value)) is not None:
        new_path, value, msg = moved
        return [(new_path, value)], [msg]
    path, messages = translate_key(path)
    path, value, more = _node_rules(path, copy.deepcopy(value))
    return [(path, value)], messages + more
