"""The runpool error hierarchy: each class's docstring is its default message.

Everything runpool raises on purpose is a RunpoolError. Where a built-in meaning applies too,
the class also derives from the built-in (InvalidInput is a ValueError, DatabaseTimeout a
TimeoutError, UsageError a RuntimeError), so code written against the built-in keeps working.
"""

from __future__ import annotations

from typing import Final

import checkpoints

__all__ = [
    "CODE_ERRORS",
    "TEXT_LIMIT",
    "AppNotFound",
    "BudgetExceeded",
    "DatabaseTimeout",
    "DatabaseUnreachable",
    "Fail",
    "InvalidInput",
    "LeaseLost",
    "NotFound",
    "RunpoolError",
    "SchemaOutOfDate",
    "ToolOutcomeUnknown",
    "UnsafeSchema",
    "UsageError",
    "WaitTimeout",
    "WorkerFailed",
    "describe",
    "one_line",
    "storable",
    "type_name",
]


# What handler code (a handler, a tool) may raise that ends its call as an error: every
# exception but the control flow (asyncio.CancelledError, waits.Suspended). KeyboardInterrupt
# and SystemExit too: a worker ignores SIGINT, so they come from the code itself (a
# sys.exit() in a handler), and let through they would end the worker process and every
# other tenant's run in it.
CODE_ERRORS: Final = (Exception, KeyboardInterrupt, SystemExit, GeneratorExit)
# The most characters of one text in an error document (a message, a traceback).
TEXT_LIMIT: Final = 4000


def describe(value: object) -> str:
    """`str(value)` for an error document or a log line, whatever the value is: handler code
    raises exceptions whose `__str__` raises (anything, SystemExit included), returns what is
    no str or a str subclass with methods of its own, or a megabyte; and passes `Fail` a
    reason that is no str. The run must still end with what can be said of it, not with an
    error of ours: the text is an exact str of at most TEXT_LIMIT characters, storable as
    JSON text (storable)."""
    try:
        text = value if type(value) is str else str(value)
        if type(text) is not str:
            text = str.__str__(text)  # a copy, as an exact str: none of the subclass's methods
    except BaseException:  # as the traceback module does: a synchronous call, no cancellation
        text = f"<{type_name(value)} str() failed>"
    return storable(text)


def one_line(exc: BaseException) -> str:
    """An error's text on one line (libpq's connection and parse errors span several)."""
    return " ".join(str(exc).split())


def type_name(value: object) -> str:
    """The name of `value`'s type, or a placeholder when even that cannot be read (a
    metaclass can make it raise)."""
    try:
        name = type(value).__name__
        return str.__str__(name) if isinstance(name, str) else "<unnamed>"
    except BaseException:
        return "<unnamed>"


def storable(text: str) -> str:
    """`text` (an exact str) cut to TEXT_LIMIT characters, then with its NUL characters
    escaped and lone surrogates replaced: JSON text PostgreSQL stores. Cut first, so a
    megabyte costs no more than its first TEXT_LIMIT characters."""
    escaped = text[:TEXT_LIMIT].replace("\x00", "\\0")[:TEXT_LIMIT]
    return escaped.encode("utf-8", "replace").decode("utf-8")


class RunpoolError(Exception):
    """runpool error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidInput(RunpoolError, ValueError):
    """Invalid argument: nothing was written."""


class NotFound(RunpoolError, LookupError):
    """No such run (or, asked for a tenant, it is another tenant's)."""


class LeaseLost(RunpoolError, checkpoints.LeaseLost):
    """This attempt no longer holds the run's lease; its writes are rejected."""


# checkpoints never imports runpool: told here, its store raises this class, which both
# `except runpool.LeaseLost` and `except checkpoints.LeaseLost` catch.
checkpoints.raise_lease_lost_as(LeaseLost)


class AppNotFound(RunpoolError):
    """The app could not be loaded: pass --app module:attribute naming a runpool.App."""


class DatabaseTimeout(RunpoolError, TimeoutError):
    """The database did not answer in time."""


class DatabaseUnreachable(RunpoolError, ConnectionError):
    """The database could not be connected to: it is down or out of reach, or it refused the
    login (no such database or role, a password)."""


class UsageError(RunpoolError, RuntimeError):
    """runpool was called in a way it does not support (e.g. a *_sync method on the loop)."""


class WorkerFailed(RunpoolError):
    """A pool's worker stopped on an internal failure (its heartbeat, listener or outcome
    writer): in-flight runs were released or are reclaimed when their leases expire."""


class SchemaOutOfDate(RunpoolError):
    """The database schema is out of date: run `python -m runpool migrate`."""


class UnsafeSchema(RunpoolError):
    """The runpool schema is controlled by a role other than the one migrating it."""


class ToolOutcomeUnknown(RunpoolError):
    """A tool call was interrupted in an earlier attempt and may not be retried: whether its
    side effect happened is unknown, and the agent must decide what to do."""

    def __init__(self, call_id: str) -> None:
        super().__init__(f"the outcome of tool call {call_id!r} is unknown: it was interrupted"
                         " in an earlier attempt and is not safe to retry")
        self.call_id = call_id


class WaitTimeout(RunpoolError, TimeoutError):
    """A durable wait (Run.wait_for, Run.join) timed out. Uncaught, the run fails (reason
    wait_timeout) without a retry: a retry would meet the same timed-out wait."""


class Fail(RunpoolError):
    """The handler failed the run; it is not retried."""

    def __init__(self, reason: str = "failed by handler") -> None:
        super().__init__(reason)
        self.reason = reason


class BudgetExceeded(RunpoolError):
    """The run's budget is spent: a total is (or the call would make it) greater than its
    maximum. Uncaught, the run ends failed with reason budget_exceeded and is not retried."""

    def __init__(self, limit: str, maximum: float, total: float) -> None:
        super().__init__(f"budget exceeded: {limit} is {maximum:g}, the run's total would be"
                         f" {total:g}")
        self.limit = limit
        self.maximum = maximum
        self.total = total


for _cls in (RunpoolError, InvalidInput, NotFound, LeaseLost, AppNotFound, DatabaseTimeout,
             DatabaseUnreachable, UsageError, WorkerFailed, SchemaOutOfDate, UnsafeSchema,
             ToolOutcomeUnknown, Fail, BudgetExceeded, WaitTimeout):
    _cls.__module__ = "runpool"
