"""Libraries the roles share. None of them is a role or starts a process.

- ``envs``: the Environment API, the rollout harness, the env registry and built-in envs
  (used by env servers, the teacher, distillation scoring and rubric replay)
- ``model``: the tiny model, tokenizer, renderer and weights I/O
- ``clients``: the inference client (request/reply on ``infer.<model>``)
- ``tasks``: what a task request asks (sampling parameters, seeds), for the orchestrator
  and ``rlbus rollout`` / ``rlbus eval`` alike
- ``plugins``: loading a user's class or function by ``module:name``
- ``threads``: a role process's torch thread count (``$RLBUS_TORCH_THREADS``)
- ``openai_api``: the OpenAI API's wire format, pure (the gateway and agent envs)
- ``curves``: a run's metrics folded into curves (``rlbus up``'s monitor, ``rlbus plot``)
- ``plotting``: drawing a run's curves, the panels ``curves.png`` and ``rlbus plot`` share
"""
