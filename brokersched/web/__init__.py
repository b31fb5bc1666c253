"""The admin API and dashboard (``pip install 'brokersched[web]'``): ``create_app(scheduler)``
is an ASGI application to mount in a Starlette/FastAPI app or to serve with
``brokersched run app:scheduler --http 127.0.0.1:8080``."""

from ._app import READ_TOKEN_ENV, TOKEN_ENV, create_app
from ._security import Authorize

__all__ = ["READ_TOKEN_ENV", "TOKEN_ENV", "Authorize", "create_app"]
