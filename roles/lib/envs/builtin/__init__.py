"""The built-in environments, by name (see ``roles.lib.envs.registry``)."""

from __future__ import annotations

from collections.abc import Callable

from roles.lib.envs.base import Environment
from roles.lib.envs.builtin import alphabet_sort, calculator, debate, relay_reverse, reverse_text

BUILTINS: dict[str, Callable[..., Environment]] = {
    "reverse-text": reverse_text.make_env,
    "alphabet-sort": alphabet_sort.make_env,
    "tool-calc": calculator.make_env,
    "relay-reverse": relay_reverse.make_env,
    "debate": debate.make_env,
}
