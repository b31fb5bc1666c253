"""Integrations with frameworks, each an optional extra: ``brokersched.contrib.django``."""
