"""Triggers: when a job's slots fall."""

from .after import AfterTrigger
from .at import AtTrigger
from .base import Trigger
from .cron import CronTrigger, parse_cron
from .interval import IntervalTrigger

__all__ = ["AfterTrigger", "AtTrigger", "CronTrigger", "IntervalTrigger", "Trigger", "parse_cron"]
