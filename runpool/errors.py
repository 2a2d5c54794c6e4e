"""The runpool error hierarchy: each class's docstring is its default message.

Everything runpool raises on purpose is a RunpoolError. Where a built-in meaning applies too,
the class also derives from the built-in (InvalidInput is a ValueError, DatabaseTimeout a
TimeoutError, UsageError a RuntimeError), so code written against the built-in keeps working.
"""

from __future__ import annotations

import checkpoints

__all__ = [
    "AppNotFound",
    "BudgetExceeded",
    "DatabaseTimeout",
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
]


def describe(value: object) -> str:
    """`str(value)` for an error document or a log line, whatever the value is: handler code
    raises exceptions whose `__str__` raises, and passes `Fail` a reason that is no str; the
    run must still end with what can be said of it, not with an error of ours."""
    if isinstance(value, str):
        return value
    try:
        return str(value)
    except Exception:
        # As the traceback module says it.
        return f"<{type(value).__qualname__} str() failed>"


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
             UsageError, WorkerFailed, SchemaOutOfDate, UnsafeSchema, ToolOutcomeUnknown, Fail,
             BudgetExceeded, WaitTimeout):
    _cls.__module__ = "runpool"
