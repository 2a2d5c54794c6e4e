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
from .schedules import Schedule

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
    """A registry of handlers by name, and of the schedules that enqueue their runs; a worker
    loads one with --app module:attribute."""

    def __init__(self) -> None:
        self._handlers: dict[str, Handler] = {}
        self._schedules: dict[str, Schedule] = {}
        # Schedules decorating a function not (yet) registered as a handler: @app.schedule
        # below @app.handler runs first.
        self._unbound: list[tuple[HandlerFn, dict[str, Any]]] = []

    def handler(
        self, name: str, *, no_retry: tuple[type[BaseException], ...] = ()
    ) -> Callable[[HandlerFn], HandlerFn]:
        if not 1 <= len(name) <= NAME_MAX_LENGTH:
            raise InvalidInput(f"handler name must be 1 to {NAME_MAX_LENGTH} characters")

        def register(fn: HandlerFn) -> HandlerFn:
            if name in self._handlers:
                raise InvalidInput(f"handler {name!r} is already registered")
            self._handlers[name] = Handler(name, fn, no_retry)
            waiting = [spec for f, spec in self._unbound if f is fn]
            self._unbound = [(f, spec) for f, spec in self._unbound if f is not fn]
            for spec in waiting:
                self._add_schedule(Schedule(handler=name, **spec))
            return fn

        return register

    def schedule(self, name: str, cron: str, *, tenant: str, input: dict[str, Any] | None = None,
                 timezone: str = "UTC", catch_up: str = "latest", priority: int = 0,
                 serial_key: str | None = None) -> Callable[[HandlerFn], HandlerFn]:
        """Run the decorated handler on a schedule: one run per plan time of `cron` (5-field
        cron or an @alias) in `timezone`, for `tenant`, with `input` plus "scheduled_at" (the
        plan time, ISO 8601 UTC). Stacks with @app.handler in either order. Validated now
        (InvalidInput); upserted by every pool that starts with this app."""
        spec: dict[str, Any] = {
            "name": name, "cron": cron, "tenant": tenant,
            "input": {} if input is None else input, "timezone": timezone,
            "catch_up": catch_up, "priority": priority, "serial_key": serial_key}
        # Checked at once, with a placeholder handler: a bad schedule fails the import.
        Schedule(handler="-", **spec)
        if name in self._schedules or any(s["name"] == name for _, s in self._unbound):
            raise InvalidInput(f"schedule {name!r} is already defined")

        def register(fn: HandlerFn) -> HandlerFn:
            handlers = [h.name for h in self._handlers.values() if h.fn is fn]
            if len(handlers) > 1:
                raise InvalidInput(f"schedule {name!r}: the function is registered as several"
                                   f" handlers ({', '.join(handlers)}); it cannot tell which")
            if handlers:
                self._add_schedule(Schedule(handler=handlers[0], **spec))
            else:
                self._unbound.append((fn, spec))
            return fn

        return register

    def _add_schedule(self, schedule: Schedule) -> None:
        if schedule.name in self._schedules:
            raise InvalidInput(f"schedule {schedule.name!r} is already defined")
        self._schedules[schedule.name] = schedule

    @property
    def schedules(self) -> list[Schedule]:
        """The app's schedules, by name. InvalidInput if one decorates a function that is not
        a handler of this app."""
        if self._unbound:
            names = ", ".join(repr(spec["name"]) for _, spec in self._unbound)
            raise InvalidInput(f"schedule(s) {names} decorate a function that is not a handler"
                               " of this app: stack @app.schedule with @app.handler")
        return [self._schedules[n] for n in sorted(self._schedules)]

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
    try:
        app.schedules  # noqa: B018 (a schedule left without its handler is refused here)
    except InvalidInput as exc:
        raise AppNotFound(f"{path!r}: {exc}") from None
    return app
