"""The trainer role: consumes ``batch.assembled`` in order, publishes ``weights.published``.

- ``loss``: the policy-gradient / SFT loss (pure torch, unit-tested against finite differences);
- ``packing``: first-fit-decreasing packing of samples into padded micro-batches;
- ``core``: ``TrainerCore``, the NATS-free training fold (also driven by replay), checkpoints;
- ``retention``: which published weights stay in the object store (``trainer.keep_weights``);
- ``sharded``: the fold on one rank of many (FSDP2 shards parameters, gradients and AdamW
  state across ``trainer.world_size`` processes);
- ``group``: a trainer on several ranks that is still one role on the bus: rank 0 starts
  the other ranks and drives them over their stdin;
- ``rank``: rank ``r > 0`` of a multi-rank trainer, running the commands rank 0 sends;
- ``role``: ``TrainerRole`` and ``main`` (``rlbus role trainer``): catch-up from the log
  after a restart, one durable consumer, weights to the object store.

Only ``role`` touches the bus; importing this package imports nothing heavy.
"""
