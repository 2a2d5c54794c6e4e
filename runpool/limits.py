"""Limits the database enforces too, for the checks Python makes before it gets there."""

from __future__ import annotations

from typing import Final

__all__ = ["NAME_MAX_LENGTH"]

# The longest tenant, handler, idempotency key, serial key, tool call id and tool name: the
# database's runpool.max_name_length() (migration 0008; tests/test_rules.py keeps them equal).
NAME_MAX_LENGTH: Final = 200
