"""The web app's statements (console.sql), loaded once."""

from __future__ import annotations

from typing import Final, LiteralString

from runpool.queries import load

__all__ = ["SQL"]

SQL: Final[dict[str, LiteralString]] = load("runpool.web", "console.sql")
