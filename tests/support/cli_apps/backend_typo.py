"""A backend refused at construction (a misspelt keyword): no job is to blame."""

from __future__ import annotations

from brokersched import RabbitMQBackend, Scheduler

scheduler = Scheduler(RabbitMQBackend("amqp://app:s3cret@127.0.0.1:1/", slot_tll="10m"))
