"""Structured logging: every record's `action`, `run_id` and `worker_id` appear as fields, as
key=value text or as one JSON object per line (RUNPOOL_LOG_FORMAT), and inside a run every
record — the handler's own loggers' included — carries the run's context (RunContextFilter).

The run's context is a context variable set by the worker in the run's task: every task and
thread the handler starts inherits it, so a record says which run it belongs to whatever
logger wrote it. trace_id/span_id come from the span current at the record (the run's
`process` span, or a tool span inside it); with tracing off, trace_id is still the run's trace
(its traceparent's, else the one derived from its id), so logs and later traces line up.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any, Final

from opentelemetry import trace

from .errors import InvalidInput

__all__ = ["FORMATS", "RunContextFilter", "in_run", "run_log_context", "setup_logging"]

FORMATS: Final = ("text", "json")
_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Fields a record may carry in `extra`, in the order a text line prints them.
_FIELDS: Final = ("action", "run_id", "worker_id", "tenant", "attempt", "handler",
                  "trace_id", "span_id")

# The context of the run whose task (or thread) this is; None outside a run.
_run: ContextVar[Mapping[str, Any] | None] = ContextVar("runpool_run_log", default=None)


class run_log_context:
    """Records made inside this block (in this task, and what it starts) carry `fields`.
    A class, not a generator: it is entered once per run, on the hot path."""

    __slots__ = ("_fields", "_token")

    def __init__(self, **fields: Any) -> None:
        self._fields = fields

    def __enter__(self) -> None:
        self._token = _run.set(self._fields)

    def __exit__(self, *exc: object) -> None:
        _run.reset(self._token)


def in_run() -> bool:
    """Whether the caller runs in a run's context (its handler's task, what that starts)."""
    return _run.get() is not None


class RunContextFilter(logging.Filter):
    """Adds the current run's fields (run_id, tenant, attempt, worker_id, trace_id, span_id)
    to a record that does not have them. Installed on runpool's own log handler; an
    application that embeds a Pool adds it to its own handlers to get the same fields."""

    def filter(self, record: logging.LogRecord) -> bool:
        fields = _run.get()
        if fields is not None:
            for name, value in fields.items():
                if not hasattr(record, name):
                    setattr(record, name, value)
        span = trace.get_current_span().get_span_context()
        if span.is_valid and fields is not None:
            # A span of this run: the exact place in its trace.
            record.trace_id = format(span.trace_id, "032x")
            record.span_id = format(span.span_id, "016x")
        return True


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
            if getattr(record, name, None) is not None
        )
        return f"{line} {extra}" if extra else line


# LogRecord's own attributes: whatever else a record holds came in `extra`.
_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime"}


class _JsonFormatter(logging.Formatter):
    """One JSON object per line. json.dumps escapes every control character, so a message
    holding newlines (a traceback, a hostile tenant name) stays on its one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_") and value is not None:
                doc[key] = value
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            doc["stack_info"] = record.stack_info
        return json.dumps(doc, default=str, ensure_ascii=False)


def _choose(value: str | None, env: str, default: str, allowed: tuple[str, ...]) -> str:
    chosen = (value or os.environ.get(env) or default).strip()
    key = chosen.upper() if env.endswith("LEVEL") else chosen.lower()
    if key not in allowed:
        raise InvalidInput(f"{env} must be one of {', '.join(allowed)}, got {chosen!r}")
    return key


def setup_logging(level: str | None = None, fmt: str | None = None) -> None:
    """Configure this process's logging (the CLI's, a pool process's): one stderr handler on
    the root logger, so the handlers' own loggers come out the same way, with the run's
    context. `level`/`fmt` default to RUNPOOL_LOG_LEVEL (INFO) and RUNPOOL_LOG_FORMAT (text);
    a bad value raises InvalidInput naming the variable."""
    level = _choose(level, "RUNPOOL_LOG_LEVEL", "INFO", _LEVELS)
    fmt = _choose(fmt, "RUNPOOL_LOG_FORMAT", "text", FORMATS)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(RunContextFilter())
    handler.setFormatter(
        _JsonFormatter() if fmt == "json"
        else _KeyValueFormatter("%(asctime)s %(levelname)s %(name)s[%(process)d]: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # runpool's records go through the root handler (one format for the whole process).
    ours = logging.getLogger("runpool")
    ours.handlers[:] = []
    ours.setLevel(level)
    ours.propagate = True
