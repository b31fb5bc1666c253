"""``python manage.py brokersched run|jobs|check|trigger JOB|history JOB [options]``.

The ``brokersched`` CLI on the scheduler named by ``settings.BROKERSCHED_SCHEDULER``
(``"module:attribute"``), imported after ``django.setup()``; options and exit codes are the
CLI's (``manage.py brokersched run --help``).
"""

from __future__ import annotations

import argparse
from typing import Any

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser

from brokersched.cli import cli

COMMANDS = ("run", "jobs", "check", "trigger", "history")


class Command(BaseCommand):
    help = "Run or inspect the scheduler named by settings.BROKERSCHED_SCHEDULER."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("command", choices=COMMANDS)
        parser.add_argument("arguments", nargs=argparse.REMAINDER, help="the command's own")

    def handle(self, *args: Any, **options: Any) -> None:
        spec = getattr(settings, "BROKERSCHED_SCHEDULER", None)
        if not isinstance(spec, str) or ":" not in spec:
            raise CommandError(
                f"settings.BROKERSCHED_SCHEDULER is {spec!r}; name the scheduler as "
                "'module:attribute', e.g. BROKERSCHED_SCHEDULER = 'reports.jobs:scheduler'"
            )
        command = options["command"]
        try:
            cli.main(
                args=[command, spec, *options["arguments"]],
                prog_name="manage.py brokersched",
                standalone_mode=True,
            )
        except SystemExit as done:
            if done.code not in (0, None):
                raise  # the CLI's exit code (1 failed, 2 usage, 3 backend down) is the process's
