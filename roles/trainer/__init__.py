"""The trainer role: consumes ``batch.assembled`` in order, publishes ``weights.published``.

- ``loss``: the policy-gradient / SFT loss (pure torch, unit-tested against finite differences);
- ``packing``: first-fit-decreasing packing of samples into padded micro-batches;
- ``core``: ``TrainerCore``, the NATS-free training fold (also driven by replay), checkpoints;
- ``retention``: which published weights stay in the object store (``trainer.keep_weights``);
- ``role``: ``TrainerRole`` and ``main`` (``rlbus role trainer``): catch-up from the log
  after a restart, one durable consumer, weights to the object store.

Only ``role`` touches the bus; importing this package imports nothing heavy.
"""
