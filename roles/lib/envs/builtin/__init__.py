"""The built-in environments, by name (see ``roles.lib.envs.registry``).

- ``reverse_text``: ``reverse-text``, reverse a short lowercase string (single turn)
- ``alphabet_sort``: ``alphabet-sort``, sort names, then keep the list sorted as names
  arrive (multi-turn)
- ``calculator``: ``tool-calc``, add two numbers by calling a calculator tool
- ``relay_reverse``: ``relay-reverse``, a two-member relay (multi-agent)
- ``debate``: ``debate``, two debaters answer a reverse-text task, a judge picks the better
"""

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
