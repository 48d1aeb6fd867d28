"""``rlbus up``: the launcher, the supervisor and what shows a run while it trains.

- ``launcher``: what ``up`` runs, in order; ``processes``: role processes (argv, start,
  stop, they die with the launcher), the run's summary
- ``run_guard``: one live launcher per run id; ``--resume`` and ``--fresh``
- ``preflight``: what is checked before any role starts (one line naming the key)
- ``cpu_plan``: which CPUs and how many threads each role process gets (``[cpus]``)
- ``supervisor``: keeps the role processes alive and follows the run's events;
  ``silence``: says when a running role stops beating, and when it beats again
- ``pools``: each env's env servers and the policy's inference replicas, static or elastic
- ``monitor``: the fold of a run's events into what the view and the summary show;
  ``role_errors``: why a role process died (the last error of its log)
- ``view``: the live terminal view; ``plots``: ``curves.png``
- ``rollout``: ``rlbus rollout``'s work (plan, requests, the missing roles, the traces),
  and ``rlbus eval``'s; ``eval_journal``: what an ``rlbus eval`` asked and each answer,
  so an interrupted eval resumes

Only the CLI (and the benchmarks) import this package.
"""
