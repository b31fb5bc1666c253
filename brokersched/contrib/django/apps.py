"""The Django application that provides ``manage.py brokersched``."""

from __future__ import annotations

from django.apps import AppConfig


class BrokerschedConfig(AppConfig):
    name = "brokersched.contrib.django"
    label = "brokersched"
    verbose_name = "brokersched"
