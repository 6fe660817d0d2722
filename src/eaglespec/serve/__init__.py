"""`eaglespec serve`: an OpenAI-compatible HTTP server over one `Engine`.

    from eaglespec import Engine
    from eaglespec.serve import ServerConfig, create_app
    app = create_app(Engine(), ServerConfig(api_key="secret"))   # any ASGI server can run it

FastAPI, uvicorn and prometheus_client are imported only when this package is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .app import ServerConfig, create_app

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
