"""Conversation and tool-call checkpoints of a run, written in the caller's transaction and
fenced by the run's lease (its attempt number). This package never imports runpool."""

from __future__ import annotations

from .models import CallMismatch, LeaseLost, Message, ToolCall, raise_lease_lost_as
from .store import (
    Statement,
    append_message,
    commit_tool_result,
    find_message,
    intent_write,
    load,
    load_paged,
    mark_tool_unknown,
    message_write,
    record_tool_intent,
    result_write,
)

__all__ = [
    "CallMismatch",
    "LeaseLost",
    "Message",
    "Statement",
    "ToolCall",
    "append_message",
    "commit_tool_result",
    "find_message",
    "intent_write",
    "load",
    "load_paged",
    "mark_tool_unknown",
    "message_write",
    "raise_lease_lost_as",
    "record_tool_intent",
    "result_write",
]
