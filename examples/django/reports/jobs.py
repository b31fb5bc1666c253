"""The project's jobs. Imported by ``manage.py brokersched``, after ``django.setup()``: models
can be imported at the top."""

import os

from django.conf import settings

from brokersched import JobContext, PostgresBackend, Scheduler
from brokersched.contrib.django import db_connections
from reports.models import Tick

scheduler = Scheduler(
    PostgresBackend(
        os.environ.get("BROKERSCHED_URL", settings.DATABASE_URL),
        schema=os.environ.get("BROKERSCHED_SCHEMA", "brokersched"),
    ),
    around_run=db_connections,  # close_old_connections() around each sync run
)


@scheduler.every("reports.tick", os.environ.get("TICK_EVERY", "1m"))
def tick(ctx: JobContext) -> None:
    """A sync handler: it runs in a worker thread, where the ORM may be used."""
    tick = Tick.objects.create(slot_ms=ctx.slot_ms, reason=ctx.reason, instance_id=ctx.instance_id)
    ctx.logger.info("tick %d saved", tick.pk)
