"""A scripted frozen teacher: answers the built-in tasks correctly over the inference protocol.

- ``role``: ``rlbus role teacher``, a frozen model endpoint that speaks the inference
  role's protocol and answers with the env's ``solve``
"""
