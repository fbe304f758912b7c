"""The HTTP control plane: the reference system's paths and bodies, served by any ASGI server.

``create_app(ctl, ...)`` returns the Starlette app (mount it in your own server, or run it with
``residency serve``); ``uvicorn_config(app, limits=ServerLimits(...))`` runs it under uvicorn
with a header timeout, a connection limit and clean closes. Needs the ``serve`` extra
(starlette, uvicorn, prometheus-client).
"""

from ._app import Generate, create_app, demo_generate
from ._server import ServerLimits, uvicorn_config

__all__ = ["Generate", "ServerLimits", "create_app", "demo_generate", "uvicorn_config"]
