"""The role runtime: what every role process is built on (no role imports another role).

- ``role``: ``Role`` (declare consumers next to handlers, ``setup``/``teardown``) and
  ``serve_role`` (connect, heartbeat, run the declared consumers, drain on SIGTERM)
- ``context``: ``RoleContext``, a role process's run, config, bus and run directory
"""
