"""An embedded PostgreSQL (pgserver) for machines without a database server."""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

from .errors import RunpoolError
from .settings import Settings

__all__ = ["resolve_dsn", "start_embedded"]

logger = logging.getLogger("runpool.embedded")


def start_embedded(data_dir: str | Path) -> str:
    """Start (or reuse) the embedded server in data_dir and return its DSN. The server outlives
    this process so workers, CLI commands and psql can share it."""
    try:
        with warnings.catch_warnings():
            # platformdirs warns when XDG_RUNTIME_DIR is unset and falls back to /tmp: harmless.
            warnings.simplefilter("ignore")
            import pgserver
    except ImportError:
        raise RunpoolError(
            "no RUNPOOL_DSN or DATABASE_URL is set and the embedded PostgreSQL is not installed:"
            " pip install 'runpool[embedded]', or point RUNPOOL_DSN at a server"
        ) from None
    path = Path(data_dir).absolute()
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        server = pgserver.get_server(path, cleanup_mode=None)  # type: ignore[attr-defined]
    return str(server.get_uri())


def resolve_dsn(settings: Settings, *, announce: bool = True) -> str:
    """The configured DSN, or an embedded server's, whose location is printed once."""
    if settings.dsn:
        return settings.dsn
    dsn = start_embedded(settings.data_dir)
    if announce:
        print(
            f"runpool: embedded PostgreSQL in {Path(settings.data_dir).absolute()}\n"
            f"runpool: connect with: psql '{dsn}'",
            file=sys.stderr,
        )
    return dsn
