"""What a run's history is made of: messages and tool calls."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

__all__ = ["CallMismatch", "LeaseLost", "Message", "ToolCall"]


class LeaseLost(Exception):
    """This attempt no longer holds the run's lease; its writes are rejected."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class CallMismatch(ValueError):
    """A call id already names a call of another tool or with other arguments."""

    def __init__(self, call_id: str) -> None:
        super().__init__(f"tool call id {call_id!r} is already used by a call of another tool"
                         " or with other arguments: give each call its own id")
        self.call_id = call_id


# The class the store raises: LeaseLost, or the subclass a library built on this package put
# into its own error hierarchy (runpool.LeaseLost), since this package never imports it.
_raised: type[LeaseLost] = LeaseLost


def raise_lease_lost_as(cls: type[LeaseLost]) -> None:
    """Make the store raise `cls`, a subclass of LeaseLost, when an attempt lost its lease."""
    global _raised
    if not issubclass(cls, LeaseLost):
        raise TypeError(f"{cls!r} is not a subclass of checkpoints.LeaseLost")
    _raised = cls


def lease_lost(message: str) -> LeaseLost:
    return _raised(message)


@dataclass(frozen=True, slots=True)
class Message:
    seq: int
    role: str
    content: Any
    attempt: int
    call_id: str | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    call_id: str
    name: str
    arguments: Any
    # started (intent only: interrupted if seen by a later attempt), succeeded, failed, unknown
    status: str
    result: Any
    attempt: int
    executions: int
    started_at: datetime
    finished_at: datetime | None

    @property
    def committed(self) -> bool:
        return self.status in ("succeeded", "failed")
