"""verifiers (v1) environments written as a verifiers user writes them, for the tests of
``vf:<module>`` envs (``roles.lib.envs.vf``): single-turn (``add``), tool-using through a
verifiers MCP tool server (``calc``, ``calc_tools``) and multi-turn with a scripted user
(``recall``). Nothing here imports rlbus."""
