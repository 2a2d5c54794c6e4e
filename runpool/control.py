"""The worker's hold on one attempt, shared with the attempt's Run.

Internal (not exported from `runpool`): the worker's slot (runpool.slot) is the only writer of
the flags below except `lose`, which the Run also calls when a write of its own finds the
lease taken; the Run reads them to fence what the handler does:

- `cancel()`: the run is being cancelled (`Run.cancelled`; no new tool call starts);
- `lose()`: the lease is (or may be) lost: every later write of this attempt raises LeaseLost;
- `close(why)`: the *_sync methods refuse all work (drain past its grace, a worker exiting);
- `renew(until)`: the lease may run out at `until` (monotonic): no tool starts past it;
- `suspend()`: the Run committed a durable wait: the run is 'waiting' and this attempt is over
  (set by the Run, read by the worker: nothing of the attempt is recorded after it; the
  worker's `on_suspend` hears it, to free the slot of a handler that goes on regardless);
- `threads`: the attempt's threads, which the worker waits for before it frees the slot.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from .threads import RunThreads

__all__ = ["RunControl"]


class RunControl:
    """On its worker's event loop; the threads of the run only read `closed`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, name: str) -> None:
        # The worker's loop, for the attempt and its slot: asyncio.get_running_loop() asks the
        # OS for the process id on Python 3.11 (a system call), twice per run otherwise.
        self.loop = loop
        # Threads of this run (a plain handler, plain tools) that have not returned yet. A
        # thread cannot be stopped: the worker keeps the run's slot and lease until none runs.
        self.threads = RunThreads(loop, name)
        self._cancelled = False
        self._lost = False
        self._closed: str | None = None
        self._suspended = False
        # Called once when the attempt suspends (the worker's; None: nobody listens).
        self.on_suspend: Callable[[], None] | None = None
        # Monotonic time after which the lease may have run out (the worker's lease clock).
        self._lease_until = math.inf

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    @property
    def lost(self) -> bool:
        return self._lost

    @property
    def suspended(self) -> bool:
        return self._suspended

    @property
    def closed(self) -> str | None:
        """Why the *_sync methods refuse all work, or None."""
        return self._closed

    @property
    def lease_until(self) -> float:
        return self._lease_until

    def cancel(self) -> None:
        self._cancelled = True

    def lose(self) -> None:
        self._lost = True

    def suspend(self) -> None:
        if not self._suspended and self.on_suspend is not None:
            self.on_suspend()
        self._suspended = True

    def close(self, why: str) -> None:
        self._closed = why

    def renew(self, until: float) -> None:
        self._lease_until = until
