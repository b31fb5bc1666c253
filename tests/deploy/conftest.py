"""The deploy tier's shared fixtures: one private RabbitMQ node for the session."""

from tests.support.private_rabbitmq import private_rabbitmq

__all__ = ["private_rabbitmq"]
