"""The handler registry a worker loads (App) and the context a handler receives (Run)."""

from __future__ import annotations

import importlib
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from .errors import AppNotFound, InvalidInput
from .limits import NAME_MAX_LENGTH

__all__ = ["App", "Handler", "load_app"]

logger = logging.getLogger("runpool.app")

if TYPE_CHECKING:
    from .context import Run

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
        if not 1 <= len(name) <= NAME_MAX_LENGTH:
            raise InvalidInput(f"handler name must be 1 to {NAME_MAX_LENGTH} characters")

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


def load_app(path: str | None) -> App:
    """The App named by `module:attribute` (attribute defaults to `app`)."""
    if not path:
        raise AppNotFound("no app given: pass --app module:attribute (or set RUNPOOL_APP)")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise AppNotFound(f"cannot import app module {module_name!r}: {exc}") from exc
    except Exception as exc:
        # The app's own code failed at import (a bad setting, a missing file): a configuration
        # problem like a missing module, told in one line; the traceback is for debugging.
        logger.debug("importing app module %r failed", module_name, exc_info=True,
                     extra={"action": "app_import_failed"})
        reason = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise AppNotFound(f"cannot import app module {module_name!r}: it raised {reason}"
                          ) from exc
    app = getattr(module, attr or "app", None)
    if not isinstance(app, App):
        raise AppNotFound(f"{path!r} is not a runpool.App")
    return app
