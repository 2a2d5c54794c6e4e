"""DNS rebinding: a console bound to the loopback interface answers only requests addressed
to it by a loopback name. Otherwise a web page whose domain an attacker re-points at 127.0.0.1
would be same-origin with the console, and could read it and press its buttons."""

from __future__ import annotations

import ipaddress
from typing import Final

from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp

__all__ = ["LOOPBACK_NAMES", "loopback_only"]

LOOPBACK_NAMES: Final = ["localhost", "127.0.0.1", "::1", "[::1]"]


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_only(app: ASGIApp, bound_to: str) -> ASGIApp:
    """app, answering only loopback Host headers when it is bound to a loopback address (a
    console bound elsewhere sits behind the operator's own proxy, which checks hosts)."""
    if not _is_loopback(bound_to):
        return app
    return TrustedHostMiddleware(app, allowed_hosts=[*LOOPBACK_NAMES, bound_to])
