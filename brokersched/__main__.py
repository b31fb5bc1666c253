"""``python -m brokersched``: the same command as the ``brokersched`` script."""

from .cli import main

main()
