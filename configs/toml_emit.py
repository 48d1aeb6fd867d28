"""A tiny TOML writer: enough for a resolved RunConfig, so a run's config can be saved
next to its log and re-run as is (`resolve(tomllib.loads(dump_toml(cfg))) == cfg`).

stdlib reads TOML but cannot write it, and tomli_w is not a dependency. TOML has no
null, so None values are omitted (every None in RunConfig is also its default).
Layout: in each table, plain values first, then sub-tables `[a.b]`, then arrays of
tables `[[a.b]]`; empty tables and mixed arrays are written inline.
"""

from __future__ import annotations

import datetime as dt
import math
import re
from typing import Any

from pydantic import BaseModel

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {
    '"': '\\"',
    "\\": "\\\\",
    "\b": "\\b",
    "\t": "\\t",
    "\n": "\\n",
    "\f": "\\f",
    "\r": "\\r",
}


def toml_string(s: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped."""
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_key(key: str) -> str:
    return key if _BARE_KEY.fullmatch(key) else toml_string(key)


def _is_table(v: Any) -> bool:
    return isinstance(v, dict) and bool(v)


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list | tuple) and bool(v) and all(_is_table(x) for x in v)


def toml_value(v: Any) -> str:
    """An inline TOML value (scalar, array or inline table)."""
    if isinstance(v, bool):  # before int: bool is an int subclass
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return repr(v)  # '1e-05', '0.5', 'inf', '-inf' are all valid TOML floats
    if isinstance(v, str):
        return toml_string(v)
    if isinstance(v, dt.datetime | dt.date | dt.time):
        return v.isoformat()
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = ", ".join(f"{toml_key(str(k))} = {toml_value(x)}" for k, x in v.items())
        return "{ " + items + " }" if items else "{}"
    if v is None:
        raise ValueError("TOML cannot represent None inside an array or inline table")
    raise TypeError(f"cannot write {type(v).__name__} as TOML: {v!r}")


def _emit_table(path: list[str], table: dict[str, Any], out: list[str], header: str) -> None:
    """Append `table` (whose header is `header`, '' for the root) and its children."""
    scalars = {k: v for k, v in table.items() if v is not None and not _is_table(v)}
    scalars = {k: v for k, v in scalars.items() if not _is_table_array(v)}
    # `[a]` may be left implicit when `[a.b]` follows; `[[a]]` never: it opens an element.
    has_children = any(_is_table(v) or _is_table_array(v) for v in table.values())
    if header and (scalars or not has_children or header.startswith("[[")):
        out.append(f"\n{header}")
    for k, v in scalars.items():
        out.append(f"{toml_key(k)} = {toml_value(v)}")
    for k, v in table.items():
        if _is_table(v):
            sub = [*path, toml_key(k)]
            _emit_table(sub, v, out, "[" + ".".join(sub) + "]")
    for k, v in table.items():
        if _is_table_array(v):
            sub = [*path, toml_key(k)]
            for item in v:
                _emit_table(sub, item, out, "[[" + ".".join(sub) + "]]")


def dumps(data: dict[str, Any]) -> str:
    """TOML text for a dict of plain Python values; None values are omitted."""
    out: list[str] = []
    _emit_table([], data, out, "")
    return "\n".join(out).lstrip("\n") + "\n"


def dump_toml(cfg: BaseModel) -> str:
    """The fully resolved config as TOML (every key, defaults included; None omitted)."""
    # Python mode, not JSON: JSON mode turns inf/nan into null and dates into strings.
    header = "# Fully resolved rlbus config (written by configs.dump_toml).\n"
    return header + dumps(cfg.model_dump(mode="python", exclude_none=True))
