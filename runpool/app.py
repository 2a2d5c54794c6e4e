"""The handler registry a worker loads (App) and the context a handler receives (Run)."""

from __future__ import annotations

import asyncio
import inspect
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias

from .errors import InvalidInput

__all__ = ["App", "Handler", "Run"]

HandlerFn: TypeAlias = Callable[["Run"], Awaitable[Any]] | Callable[["Run"], Any]


@dataclass(frozen=True, slots=True)
class Handler:
    name: str
    fn: HandlerFn
    # Exceptions that fail the run at once instead of retrying (runpool.Fail always does).
    no_retry: tuple[type[BaseException], ...] = ()

    @property
    def is_async(self) -> bool:
        return inspect.iscoroutinefunction(self.fn)


class App:
    """A registry of handlers by name; a worker loads one with --app module:attribute."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}

    def handler(
        self, name: str, *, no_retry: tuple[type[BaseException], ...] = ()
    ) -> Callable[[HandlerFn], HandlerFn]:
        if not 1 <= len(name) <= 200:
            raise InvalidInput("handler name must be 1 to 200 characters")

        def register(fn: HandlerFn) -> HandlerFn:
            if name in self._handlers:
                raise InvalidInput(f"handler {name!r} is already registered")
            self._handlers[name] = Handler(name, fn, no_retry)
            return fn

        return register

    def get(self, name: str) -> Handler | None:
        return self._handlers.get(name)

    @property
    def names(self) -> list[str]:
        return sorted(self._handlers)


class Run:
    """One attempt of a run, as its handler sees it.

    The worker owns this object: it sets the cancellation flag (from a NOTIFY or a heartbeat);
    the handler only reads it.
    """

    __slots__ = ("_cancelled", "attempt", "handler", "id", "input", "tenant")

    def __init__(
        self, *, id: uuid.UUID, tenant: str, handler: str, attempt: int, input: Any
    ) -> None:
        self.id = id
        self.tenant = tenant
        self.handler = handler
        self.attempt = attempt
        self.input = input
        self._cancelled = asyncio.Event()

    @property
    def cancelled(self) -> bool:
        """True once a cancellation of this run reached the worker."""
        return self._cancelled.is_set()

    def _mark_cancelled(self) -> None:
        self._cancelled.set()

    def __repr__(self) -> str:
        return f"Run(id={self.id}, tenant={self.tenant!r}, attempt={self.attempt})"
