"""The bus: NATS JetStream and nothing else (only this package imports the NATS client).

- ``subjects``: the one registry of topics, subjects, streams, buckets and consumers
- ``kinds``: the role registry: every kind of client (its identity on the bus) and every
  role process (what ``rlbus role <name>`` runs), once
- ``auth``: one identity per role kind per run, its permissions, and the credentials files
- ``natsconf``: nats-server configuration files (listen address, store, users, cluster, TLS)
- ``server``: the embedded nats-server (start, stop, restart), and ``reachable_server``
- ``cluster``: a JetStream cluster of several routed nats-server nodes (loopback or files)
- ``codec``: events to bytes and headers, and decoding them back to declared types
- ``runtime``: ``Bus``, a connection to one run: publishing events with dedup ids and acks
- ``settings``: ``BusSettings``, the bus's settings and their defaults (the config's too)
- ``consumer``: the durable pull-consumer loop (fetch, decode, handle, publish, then ack;
  ``Effects``, dead letters)
- ``follower``: the second consumer kind, a follower of the log declared next to its handler
- ``reader``: the one log reader, a run's stored events in stream order (legacy upcast)
- ``rpc``: request/reply over core NATS with queue groups (inference traffic, not stored)
- ``offload``: large bodies in the run's JetStream Object Store, verified by digest
- ``waits``: ``unless_stopped``, work an event cuts short (a role stopping, the
  connection coming back after it lost its server)
- ``registry``: the live role registry: a KV bucket of heartbeats, one key per role
  instance (not ``kinds``, which declares the roles)
- ``errors``: typed errors of the bus boundary, and what the NATS client's errors mean
- ``log``: structlog set-up (JSON lines for machines, a plain line for a person)
- ``children``: child processes that do not outlive their parent (parent-death signal)
- ``sandbox``: role processes that cannot read another identity's secrets (Landlock)
"""
