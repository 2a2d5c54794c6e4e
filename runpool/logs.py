"""Structured logging: every record's `action`, `run_id` and `worker_id` appear as fields."""

from __future__ import annotations

import json
import logging
import re
import sys

__all__ = ["setup_logging"]

_FIELDS = ("action", "run_id", "worker_id", "tenant", "attempt")


# A value that could break the line's key=value shape: whitespace, quotes, '=' or any control
# or non-ASCII character.
_UNSAFE = re.compile(r'[\s"=\\]|[^\x21-\x7e]')


def _value(value: object) -> str:
    """A field's value, JSON-quoted when it is not a plain token: tenants come from callers,
    and a tenant holding a newline must not forge a log line."""
    text = str(value)
    return json.dumps(text) if not text or _UNSAFE.search(text) else text


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(
            f"{name}={_value(getattr(record, name))}" for name in _FIELDS
            if hasattr(record, name)
        )
        return f"{line} {extra}" if extra else line


def setup_logging(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _KeyValueFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s")
    )
    root = logging.getLogger("runpool")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False
