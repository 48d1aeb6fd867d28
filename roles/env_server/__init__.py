"""The env server role: ``task.requested.<env>`` in, rollouts through inference,
``trace.completed.<env>`` / ``eval.completed.<env>`` out (``rlbus role env``).

The environments themselves are a library (``roles.lib.envs``); this package is the
process that serves them: ``role`` (the server, its metrics and the inference client
adapted to the rollout harness).
"""
