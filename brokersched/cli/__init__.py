"""The ``brokersched`` command (``pip install 'brokersched[cli]'``).

``run`` serves a scheduler until SIGINT/SIGTERM; ``jobs``, ``next`` and ``check`` only read the
application (they never connect to the backend); ``history`` and ``trigger`` connect for one
request. An application is named ``module:attribute`` (``app:scheduler``) or
``path/to/file.py:attribute`` (``./app.py:scheduler``), where the attribute is a ``Scheduler``
or a function of no arguments that returns one. A module is searched from the current directory
first, as ``python -m`` would; a file is imported under its module name with the directory above
its package (or its own directory) first on ``sys.path``, as Flask's ``--app`` does, so that
its imports of its neighbours work as they do under ``python path/to/file.py``.

User mistakes end in one line on stderr and an exit code, never a traceback; only an exception
raised by the application's own code while it is imported (or while its factory runs) shows its
traceback: it is a bug to find there.

The group is defined in ``_group``; each command module registers its commands on it when it
is imported, here.
"""

from __future__ import annotations

from . import _controls, _inspect, _manual, _ops, _plan, _records, _run, _schedules
from ._app import load_scheduler
from ._group import cli

__all__ = ["cli", "load_scheduler", "main"]

_COMMANDS = (
    _controls,
    _inspect,
    _manual,
    _ops,
    _plan,
    _records,
    _run,
    _schedules,
)  # imported for their registration


def main() -> None:
    """The console script: ``brokersched``."""
    cli(prog_name="brokersched")
