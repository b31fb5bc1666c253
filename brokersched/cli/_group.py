"""The ``brokersched`` click group, on which each command module registers its commands,
and the epilog every command's help ends with."""

from __future__ import annotations

import click

__all__ = ["EPILOG", "cli"]

EPILOG = """\b
APP: MODULE:ATTR (app:scheduler) or FILE.py:ATTR (./app.py:scheduler)
\b
Exit codes:
  0  success
  1  trigger: the job failed or did not run; backfill: a slot failed or was skipped,
     or a dry run found nothing of the prefix on the backend;
     check: configuration errors found;
     run: a second signal cut the drain short; run, trigger: the application's lifespan raised;
     purge: refused, or objects left; doctor: an error found;
     simulate: a promise of the README broke in a seed;
     plan: a slot runs twice, never or under another owner during the deploy;
     schedules: no such schedule, an --if-version conflict, or an import's entries refused
  2  usage or configuration error (bad APP, unknown job, invalid option)
  3  the backend is unavailable
"""


@click.group(epilog=EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="brokersched", prog_name="brokersched")
def cli() -> None:
    """Run scheduled jobs on every instance; each occurrence runs on exactly one.

    APP names the application's scheduler: MODULE:ATTR (app:scheduler, myapp.tasks:scheduler)
    or FILE.py:ATTR (./app.py:scheduler); ATTR may also be a function of no arguments that
    returns the scheduler.
    """
