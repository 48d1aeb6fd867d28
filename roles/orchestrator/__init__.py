"""The orchestrator: a pure fold over the run's log plus a policy that decides what to publish."""
