"""A minimal Django project whose jobs run through ``manage.py brokersched run``.

``DATABASE_URL`` (``postgresql://user@host:port/name``) is the ORM's database; the scheduler
claims its slots in the same PostgreSQL, schema ``BROKERSCHED_SCHEMA`` (see reports/jobs.py).
"""

import os
from urllib.parse import unquote, urlsplit

DATABASE_URL = os.environ.get("DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/test")
_db = urlsplit(DATABASE_URL)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "only-for-the-example")
DEBUG = False
ALLOWED_HOSTS: list[str] = []
USE_TZ = True
TIME_ZONE = "UTC"
INSTALLED_APPS = ["brokersched.contrib.django", "reports"]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": _db.path.lstrip("/"),
        "USER": unquote(_db.username or ""),
        "PASSWORD": unquote(_db.password or ""),
        "HOST": _db.hostname or "",
        "PORT": str(_db.port or ""),
        # Persistent connections, checked when a run (a request) begins: what a service runs.
        "CONN_MAX_AGE": 600,
        "CONN_HEALTH_CHECKS": True,
        "OPTIONS": {"application_name": "brokersched-django-example"},
    }
}

# The scheduler `manage.py brokersched ...` loads, after django.setup().
BROKERSCHED_SCHEDULER = "reports.jobs:scheduler"
