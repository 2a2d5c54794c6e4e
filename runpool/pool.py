"""runpool.Pool: run slots inside an existing asyncio application.

    async with runpool.Pool(app, dsn=dsn, concurrency=20) as pool:
        ...                      # the application's own work; runs are claimed meanwhile
        await pool.drain()       # optional: leaving the block drains too

A Pool is one worker's worth of slots, and the very code a worker process of `python -m runpool
worker` runs (that process is a Pool behind signal handlers). Embedded, it touches nothing
process-wide: it forks nothing, installs no signal handler, configures no logging, and never
installs a tracer provider (it traces through the one it is given, else the global one the
host set, else not at all).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import fields, replace
from types import TracebackType
from typing import Any

from .app import App, load_app
from .db import DSN_SETTING, check_stateless, reach
from .errors import InvalidInput, WorkerFailed
from .migrate import check
from .settings import Settings
from .worker import Worker

__all__ = ["Pool"]

logger = logging.getLogger("runpool.pool")

_OPTIONS = frozenset(f.name for f in fields(Settings)) - {"dsn", "app", "workers", "data_dir"}


class Pool:
    """Run slots on the caller's event loop, claiming from the database at `dsn`.

    `app` is a runpool.App or its `module:attribute` path. `settings` (a Settings) and keyword
    `options` (any Settings field: lease_seconds, poll_seconds, grace_seconds, listen, ...)
    tune it; the environment (RUNPOOL_*) is not read: the host application configures it.
    `notices_fd` is for `python -m runpool`'s workers: the worker end of the host's notice
    relay (runpool.relay), read instead of a LISTEN connection of the pool's own.
    """

    def __init__(self, app: App | str, *, dsn: str, concurrency: int | None = None,
                 settings: Settings | None = None, tracer_provider: Any = None,
                 notices_fd: int | None = None, **options: Any) -> None:
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            raise InvalidInput(f"unknown Pool option(s) {unknown}; known: {sorted(_OPTIONS)}")
        if not isinstance(dsn, str) or not dsn:
            raise InvalidInput("dsn must be a PostgreSQL connection string")
        if concurrency is not None:
            options["concurrency"] = concurrency
        base = settings if settings is not None else Settings(workers=1)
        self.settings = replace(base, dsn=dsn, **options)
        self.app = app if isinstance(app, App) else load_app(app)
        self.app.schedules  # noqa: B018 (InvalidInput now for a schedule without its handler)
        self._worker = Worker(self.settings, self.app, dsn, tracer_provider=tracer_provider,
                              notices_fd=notices_fd)
        self._stop = asyncio.Event()
        self._abort = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def worker_id(self) -> uuid.UUID:
        """This pool's id in runpool.workers (and on its log lines and claims)."""
        return self._worker.id

    @property
    def exit_code(self) -> int:
        """0, or what the process should exit with: 75 once a run's plain-def handler thread
        outlived its grace (a thread cannot be stopped; it ends with its process)."""
        return self._worker.exit_code

    @property
    def in_flight(self) -> int:
        """Runs in this pool's slots now."""
        return len(self._worker.slots)

    async def start(self) -> None:
        """Check the schema, then start claiming; returns once the worker is registered.

        Raises DatabaseUnreachable when it cannot connect at all (a ConnectionError),
        SchemaOutOfDate on a database this runpool does not match (run `python -m runpool
        migrate`), UsageError behind a pooler whose database would not run runpool's
        statements read committed or whose listen_dsn reaches another database (see
        db.check_stateless), and whatever stopped the worker from starting.
        """
        if self._task is not None:
            raise InvalidInput("this Pool was started already; a Pool runs once")
        await asyncio.to_thread(_check_schema, self._worker.dsn, self.settings.listen_dsn)
        self._task = asyncio.create_task(self._worker.run(self._stop, self._abort),
                                         name=f"runpool-worker-{self.worker_id}")
        started = asyncio.ensure_future(self._worker.ready.wait())
        try:
            await asyncio.wait({self._task, started}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            started.cancel()
        if self._task.done():
            await self._join()

    def stop(self, *, now: bool = False) -> None:
        """Ask the pool to stop claiming and drain (finish in-flight runs within
        grace_seconds, then release the rest); `now`: release in-flight runs at once.
        Returns at once (safe from a signal handler); `wait()` for the pool to be done."""
        if now:
            self._abort.set()
        self._stop.set()

    async def wait(self) -> None:
        """Until the pool has stopped: after `stop()`, or on a failure (WorkerFailed), which
        includes a handler thread that could not be stopped (see `exit_code`)."""
        if self._task is None:
            return
        await self._join()
        if self.exit_code:
            raise WorkerFailed(
                f"worker {self.worker_id} stopped: a run's handler thread could not be stopped;"
                " it ends with this process, and its run is reclaimed when its lease expires")

    async def drain(self) -> None:
        """Stop gracefully: no new claims, in-flight runs finish (or are released back to the
        queue after grace_seconds, keeping their attempt); returns when all is settled."""
        self.stop()
        await self.wait()

    async def _join(self) -> None:
        assert self._task is not None
        try:
            await asyncio.shield(self._task)
        except WorkerFailed:
            raise
        except asyncio.CancelledError:
            if not self._task.cancelled():
                raise  # the caller was cancelled, not the worker
            raise WorkerFailed(f"worker {self.worker_id} was cancelled") from None

    async def __aenter__(self) -> Pool:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        # Leaving on an error still drains; leaving because the host is being cancelled (its
        # shutdown) releases in-flight runs at once instead of holding the shutdown up.
        self.stop(now=exc_type is not None and issubclass(exc_type, asyncio.CancelledError))
        try:
            await self.wait()
        except WorkerFailed:
            if exc is None:
                raise
            logger.exception("the pool's worker failed", extra={
                "action": "pool_failed", "worker_id": str(self.worker_id)})


def _check_schema(dsn: str, listen_dsn: str | None) -> None:
    with reach(dsn, DSN_SETTING, stateless=listen_dsn is not None) as conn:
        check(conn)
        if listen_dsn is not None:
            check_stateless(conn, listen_dsn)
