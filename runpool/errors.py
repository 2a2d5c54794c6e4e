"""The runpool error hierarchy: each class's docstring is its default message."""

from __future__ import annotations

# One class for both packages: checkpoints raises it, handlers catch runpool.LeaseLost.
from checkpoints import LeaseLost

__all__ = [
    "Fail",
    "InvalidInput",
    "LeaseLost",
    "RunpoolError",
    "SchemaOutOfDate",
    "ToolOutcomeUnknown",
    "UnsafeSchema",
]


class RunpoolError(Exception):
    """runpool error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidInput(RunpoolError, ValueError):
    """Invalid argument: nothing was written."""


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


class Fail(RunpoolError):
    """The handler failed the run; it is not retried."""

    def __init__(self, reason: str = "failed by handler") -> None:
        super().__init__(reason)
        self.reason = reason


for _cls in (RunpoolError, InvalidInput, SchemaOutOfDate, UnsafeSchema, ToolOutcomeUnknown,
             Fail):
    _cls.__module__ = "runpool"
