"""The two things configs raise: a bad-config error and a deprecated-spelling warning.

Kept in their own module so models, translation and loading can all use them
without importing each other.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config that cannot be loaded or validated; the message names every bad key."""


class ConfigDeprecationWarning(FutureWarning):
    """An old config spelling that still works but will be removed.

    A FutureWarning (shown by default) rather than a DeprecationWarning (hidden
    outside `__main__`): the audience is the user who wrote the TOML, not a developer.
    """
