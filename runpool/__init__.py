"""runpool: a worker pool for long-running LLM agent runs, coordinated only through PostgreSQL."""

from __future__ import annotations

from .app import App, Run
from .enqueue import RunSpec, enqueue, enqueue_async, enqueue_many
from .errors import Fail, InvalidInput, LeaseLost, RunpoolError, SchemaOutOfDate
from .settings import Settings

__all__ = [
    "App",
    "Fail",
    "InvalidInput",
    "LeaseLost",
    "Run",
    "RunSpec",
    "RunpoolError",
    "SchemaOutOfDate",
    "Settings",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
]
