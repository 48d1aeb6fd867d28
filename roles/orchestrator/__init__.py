"""The orchestrator: a pure fold over the run's log plus a policy that decides what to publish.

- ``core``: ``OrchestratorCore``, the pure transition: one event in (check, fold, decide),
  the decisions it causes out (orchestrator replay drives it too)
- ``state``: ``OrchestratorState``, the fold over the run's events (``check``, ``apply``)
- ``policy``: the decisions, ``decide(state, cfg)``: dispatches, batches, evals, metrics,
  the stop
- ``merge``: the samples several algorithms scored from the same branch merged into one
- ``eval_stats``: eval figures per env (avg@k, its standard error, pass@k), also
  ``rlbus eval``'s
- ``role``: the process (``rlbus role orchestrator``): follows the log from sequence 1
  through the core and publishes what it decides
"""
