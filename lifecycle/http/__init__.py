"""The HTTP control plane: the reference system's paths and bodies, served by any ASGI server.

``create_app(ctl, ...)`` returns the Starlette app (mount it in your own server, or run it with
``residency serve``). Needs the ``serve`` extra (starlette, uvicorn, prometheus-client).
"""

from ._app import Generate, create_app, demo_generate

__all__ = ["Generate", "create_app", "demo_generate"]
