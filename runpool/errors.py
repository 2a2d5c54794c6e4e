"""The runpool error hierarchy: each class's docstring is its default message."""

from __future__ import annotations

__all__ = [
    "Fail",
    "InvalidInput",
    "LeaseLost",
    "RunpoolError",
    "SchemaOutOfDate",
]


class RunpoolError(Exception):
    """runpool error."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class InvalidInput(RunpoolError, ValueError):
    """Invalid argument: nothing was written."""


class SchemaOutOfDate(RunpoolError):
    """The database schema is out of date: run `python -m runpool migrate`."""


class LeaseLost(RunpoolError):
    """This attempt no longer holds the run's lease; its writes are rejected."""


class Fail(RunpoolError):
    """The handler failed the run; it is not retried."""

    def __init__(self, reason: str = "failed by handler") -> None:
        super().__init__(reason)
        self.reason = reason


for _cls in (RunpoolError, InvalidInput, SchemaOutOfDate, LeaseLost, Fail):
    _cls.__module__ = "runpool"
