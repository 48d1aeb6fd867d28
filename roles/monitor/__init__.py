"""The monitor role: a run's metrics into the tools practitioners already have open.

- ``feed``: the one mapping of events to scalars (``MetricFeed``), shared by the live role
  and ``rlbus monitor <run>`` on a finished run;
- ``sinks``: TensorBoard event files and Weights & Biases runs (``make_sinks``);
- ``role``: ``rlbus role monitor``, a follower of the run's metrics feeding the sinks,
  started by ``rlbus up`` when ``[monitor] sinks`` is not empty.
"""
