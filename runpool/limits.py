"""Limits the database enforces too, for the checks Python makes before it gets there."""

from __future__ import annotations

from typing import Final

from .errors import InvalidInput

__all__ = ["NAME_MAX_LENGTH", "check_name", "check_tenant", "check_text"]

# The longest tenant, handler, idempotency key, serial key, tool call id and tool name: the
# database's runpool.max_name_length() (migration 0008; tests/test_rules.py keeps them equal).
NAME_MAX_LENGTH: Final = 200


def check_text(what: str, value: str) -> None:
    """Text PostgreSQL can store: no NUL, and valid UTF-8 (a lone surrogate is not; orjson and
    psycopg would raise a bare encoding error for it instead, after a write was begun)."""
    if "\x00" in value:
        raise InvalidInput(f"{what} contains a NUL (0x00) character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidInput(f"{what} is not valid UTF-8 text: {exc.reason} at position"
                           f" {exc.start}") from None


def check_name(value: object, what: str, max_length: int = NAME_MAX_LENGTH) -> str:
    """A name (a message role, a tool call id or name, a signal name, a cost key): a string of
    1 to `max_length` characters that check_text accepts."""
    if not isinstance(value, str) or not 1 <= len(value) <= max_length:
        raise InvalidInput(f"{what} must be 1 to {max_length} characters")
    check_text(what, value)
    return value


def check_tenant(value: object) -> str | None:
    """A caller's tenant scope (signal_run, resolve_tool_call, wait, follow, cancel): None
    (any tenant's run), or a name."""
    return None if value is None else check_name(value, "tenant")
