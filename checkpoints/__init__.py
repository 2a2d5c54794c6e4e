"""Conversation and tool-call checkpoints of a run, written in the caller's transaction and
fenced by the run's lease (its attempt number). This package never imports runpool."""

from __future__ import annotations

from .models import CallMismatch, LeaseLost, Message, ToolCall, raise_lease_lost_as
from .store import (
    append_message,
    commit_tool_result,
    find_message,
    load,
    load_paged,
    mark_tool_unknown,
    record_tool_intent,
)

__all__ = [
    "CallMismatch",
    "LeaseLost",
    "Message",
    "ToolCall",
    "append_message",
    "commit_tool_result",
    "find_message",
    "load",
    "load_paged",
    "mark_tool_unknown",
    "raise_lease_lost_as",
    "record_tool_intent",
]
