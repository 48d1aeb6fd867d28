"""``python -m roles.cli`` is ``rlbus``."""

from roles.cli import main

main()
