"""``python -m brokersched.cli``: the same command as the ``brokersched`` script."""

from . import main

main()
