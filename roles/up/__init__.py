"""``rlbus up``: the launcher, the supervisor and what shows a run while it trains.

- ``launcher``: what ``up`` runs, in order; ``processes``: role processes (argv, start,
  stop, they die with the launcher), the run's summary
- ``run_guard``: one live launcher per run id; ``--resume`` and ``--fresh``
- ``preflight``: what is checked before any role starts (one line naming the key)
- ``supervisor``: keeps the role processes alive and follows the run's events
- ``monitor``: the fold of a run's events into what the view and the summary show;
  ``role_errors``: why a role process died (the last error of its log)
- ``view``: the live terminal view; ``plots``: ``curves.png``
- ``rollout``: ``rlbus rollout``'s work (plan, requests, the missing roles, the traces)

Only the CLI (and the benchmarks) import this package.
"""
