"""Backends, one module each. Import them by module (``brokersched.backends.nats``) or from
``brokersched``; each client library is imported only when its backend starts."""
