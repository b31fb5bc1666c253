from django.db import models


class Tick(models.Model):
    """One row per run of the ``reports.tick`` job."""

    slot_ms = models.BigIntegerField()
    reason = models.CharField(max_length=16)
    instance_id = models.CharField(max_length=200)
    created_at = models.DateTimeField(auto_now_add=True)
