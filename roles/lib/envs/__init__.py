"""Environments: a library used by env servers, the teacher and rubric replay.

- ``base``: the Environment API (Taskset, Harness, Rubric, Environment), pure
- ``builtin``: ``reverse-text``, ``alphabet-sort``, ``tool-calc`` and ``relay-reverse``
- ``registry``: ``make_env(env_id, args)`` by built-in name or ``module:callable``
- ``harness``: one rollout over token-in/token-out rendering -> ``schemas.Trace``

The process that serves them is the env server role (``roles.env_server``). This
package imports nothing heavy.
"""
