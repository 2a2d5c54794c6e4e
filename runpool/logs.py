"""Structured logging: every record's `action`, `run_id` and `worker_id` appear as fields."""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]

_FIELDS = ("action", "run_id", "worker_id", "tenant", "attempt")


class _KeyValueFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(
            f"{name}={getattr(record, name)}" for name in _FIELDS if hasattr(record, name)
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
