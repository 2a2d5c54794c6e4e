"""runpool: a worker pool for long-running LLM agent runs, coordinated only through PostgreSQL."""

from __future__ import annotations

from checkpoints import Message, ToolCall

from .app import App
from .context import Run
from .enqueue import RunSpec, enqueue, enqueue_async, enqueue_many
from .errors import (
    Fail,
    InvalidInput,
    LeaseLost,
    RunpoolError,
    SchemaOutOfDate,
    ToolOutcomeUnknown,
)
from .resolve import resolve_tool_call
from .settings import Settings

__all__ = [
    "App",
    "Fail",
    "InvalidInput",
    "LeaseLost",
    "Message",
    "Run",
    "RunSpec",
    "RunpoolError",
    "SchemaOutOfDate",
    "Settings",
    "ToolCall",
    "ToolOutcomeUnknown",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "resolve_tool_call",
]
