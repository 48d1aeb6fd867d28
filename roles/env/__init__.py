"""Environments and the env server role.

- ``base``: the Environment API (Taskset, Harness, Rubric, Environment), pure
- ``builtin``: ``reverse-text`` and ``alphabet-sort``
- ``registry``: ``make_env(env_id, args)`` by built-in name or ``module:callable``
- ``harness``: one rollout over token-in/token-out rendering -> ``schemas.Trace``
- ``server``: the env server role (``rlbus role env --run R --env reverse-text``)

This package imports nothing heavy; ``server`` loads the tokenizer (transformers).
"""
