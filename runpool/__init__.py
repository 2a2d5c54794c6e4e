"""runpool: a worker pool for long-running LLM agent runs, coordinated only through PostgreSQL."""

from __future__ import annotations

from checkpoints import Message, ToolCall

from .app import App
from .context import Run
from .enqueue import RunSpec, enqueue, enqueue_async, enqueue_many
from .errors import (
    AppNotFound,
    BudgetExceeded,
    DatabaseTimeout,
    DatabaseUnreachable,
    Fail,
    InvalidInput,
    LeaseLost,
    NotFound,
    RunpoolError,
    SchemaOutOfDate,
    ToolOutcomeUnknown,
    UnsafeSchema,
    UsageError,
    WaitTimeout,
    WorkerFailed,
)
from .live import RunEvent, RunResult, follow, wait, wait_async
from .live_hub import FollowHub
from .pool import Pool
from .resolve import resolve_tool_call
from .settings import Settings
from .waits import signal_run

__version__ = "0.1.0"

__all__ = [
    "App",
    "AppNotFound",
    "BudgetExceeded",
    "DatabaseTimeout",
    "DatabaseUnreachable",
    "Fail",
    "FollowHub",
    "InvalidInput",
    "LeaseLost",
    "Message",
    "NotFound",
    "Pool",
    "Run",
    "RunEvent",
    "RunResult",
    "RunSpec",
    "RunpoolError",
    "SchemaOutOfDate",
    "Settings",
    "ToolCall",
    "ToolOutcomeUnknown",
    "UnsafeSchema",
    "UsageError",
    "WaitTimeout",
    "WorkerFailed",
    "__version__",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
    "follow",
    "resolve_tool_call",
    "signal_run",
    "wait",
    "wait_async",
]
