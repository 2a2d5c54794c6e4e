"""runpool.web: the run API over HTTP, the operator console, /metrics and /healthz, as one
ASGI application (Starlette). Install with `pip install 'runpool[web]'`; serve the console
with `python -m runpool ui`, or mount `create_app(tenant_of=...)` in a product's service."""

from __future__ import annotations

from .app import create_app

__all__ = ["create_app"]
