"""The lake role: keeps a run's Parquet lake (``replay.lake``) in sync while it runs.

- ``role``: the process (``rlbus role lake``), syncing every few seconds.
"""
