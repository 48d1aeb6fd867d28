"""The roles: every process of a run, what they share, the launcher and the command line.

Each role package keeps its process code in ``role.py``; the rest of it is its pure core,
importable without a broker. No role package imports another.

- ``runtime``: what every role process is built on (``Role``, ``serve_role``, ``RoleContext``)
- ``orchestrator``: a pure fold over the run's log plus a policy that decides what to publish
- ``env_server``: runs rollout groups of one environment against inference
  (``task.requested`` in, ``trace.completed`` / ``eval.completed`` out)
- ``inference``: answers generate/score requests for one model, follows published weights
- ``algorithm``: algorithm workers: complete groups of traces in, scored samples out
- ``trainer``: trains on ``batch.assembled`` in order, publishes ``weights.published``
- ``teacher``: a scripted frozen teacher that answers the built-in tasks correctly
- ``gateway``: an OpenAI-compatible HTTP endpoint over the bus's inference
- ``lake``: keeps a run's Parquet lake in sync while it runs (the one role importing replay)
- ``monitor``: a run's metrics into TensorBoard or Weights & Biases
- ``lib``: libraries the roles share (envs, model, inference client, ...), no process code
- ``up``: ``rlbus up``: the launcher, the supervisor and the live view
- ``cli``: the ``rlbus`` command line (a typer app; command modules only)
"""
