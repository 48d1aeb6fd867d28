"""The gateway role: an OpenAI-compatible HTTP endpoint over the bus's inference.

- ``role``: the aiohttp server and its bus client (``rlbus role gateway``, ``rlbus serve``);
  the wire format is ``roles.lib.openai_api``.
"""
