"""Environments: a library used by env servers, the teacher and rubric replay.

- ``base``: the Environment API (Taskset, Harness, Rubric, Environment), pure
- ``builtin``: ``reverse-text``, ``alphabet-sort``, ``tool-calc``, ``relay-reverse`` and ``debate``
- ``registry``: ``make_env(env_id, args)`` by built-in name or ``module:callable``
- ``harness``: one rollout over token-in/token-out rendering -> ``schemas.Trace``
- ``stop``: why a rollout ended (``Trace.stop_condition``) and the one priority rule
- ``group``: group rubrics: a group's finished rollouts scored together (in sample
  order), their values recorded on each trace before it is published
- ``agent``: an env whose own code drives the conversation through an OpenAI client
  (``AgentHarness``), each policy call a turn of the trace
- ``chat``: recorded messages as chat dicts, replies parsed into tool calls, the checks
  that tell a bug in env code (``EnvCodeError``) from a model's mistake
- ``filters``: rollout filters (gibberish, repetition, length, user detectors) -> the
  trace's ``filters``/``is_filtered`` verdict
- ``seats``: who plays which member of a multi-agent rollout
- ``vf``: verifiers environments, unchanged (``vf:<module>`` runs a verifiers taskset)

The process that serves them is the env server role (``roles.env_server``). This
package imports nothing heavy.
"""
