"""The threads of one run — a plain `def` handler, plain `def` tools — tracked until they
really return. A thread cannot be stopped: cancelling the task that awaits it ends the await,
not the thread, so the worker keeps the run (slot, lease, status) until `running` is False."""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from .errors import describe, type_name

__all__ = ["RunThreads"]

T = TypeVar("T")


class RunThreads:
    """Owned by one Run, on its worker's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        self._loop = loop
        self._name = name
        # One future per thread not yet returned; never cancelled (shielded from its callers).
        self._futures: set[asyncio.Future[Any]] = set()

    @property
    def running(self) -> bool:
        return bool(self._futures)

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) in a thread of its own (with the caller's context variables).

        Cancelling the caller raises CancelledError here at once; the thread goes on and is
        tracked until fn returns. A daemon thread, not an executor's: an interpreter joins
        executor threads at exit, so a thread that never returns would hold its process (a
        worker, or an application embedding a Pool) forever; it must end with the process.
        """
        future: asyncio.Future[T] = self._loop.create_future()
        context = contextvars.copy_context()

        def body() -> None:
            try:
                result = context.run(fn, *args)
            except BaseException as exc:  # handed to the loop, as an executor would
                self._settle(future, None, exc)
            else:
                self._settle(future, result, None)

        self._futures.add(future)
        future.add_done_callback(self._done)
        threading.Thread(target=body, name=self._name, daemon=True).start()
        return await asyncio.shield(future)

    async def finished(self) -> None:
        """Returns once no thread runs. Cancelling the caller raises here and leaves the
        threads' futures alone (asyncio.wait never cancels what it waits for)."""
        while self._futures:
            await asyncio.wait(set(self._futures))

    def _settle(self, future: asyncio.Future[Any], result: Any,
                exc: BaseException | None) -> None:
        """From the thread: complete its future on the loop."""
        def settle() -> None:
            if future.done():
                return
            if exc is None:
                future.set_result(result)
            elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
                # Not the awaiting task's own cancellation: an error of the thread's code. (A
                # GeneratorExit thrown into the awaiting task would close the coroutines it
                # awaits, and the run's own code after them could never record its end.)
                # (type_name, describe: this callback must not raise, or the future is
                # never settled and the run's slot is held for good.)
                future.set_exception(RuntimeError(
                    f"the thread raised {type_name(exc)}: {describe(exc)}"))
            else:
                future.set_exception(exc)

        try:
            self._loop.call_soon_threadsafe(settle)
        except RuntimeError:
            pass  # the loop is closed: its worker is gone and nobody waits any more

    def _done(self, future: asyncio.Future[Any]) -> None:
        self._futures.discard(future)
        if not future.cancelled():
            future.exception()  # retrieved: nobody awaits a thread whose caller was cancelled
