"""A run in progress in a worker slot — its claim, its RunControl and its task — with the only
transitions of its state, and the worker's table of slots, which a slot leaves in one place."""

from __future__ import annotations

import asyncio
import enum
import math
import time
import uuid
from collections.abc import Coroutine, Iterator
from typing import Any

from .claiming import ClaimedRun
from .control import RunControl

__all__ = ["Slot", "Slots", "StopReason"]


class StopReason(enum.Enum):
    """Why the worker stopped a run's task before the handler returned by itself."""

    # A cancel was requested (a NOTIFY confirmed, or the heartbeat's flag): the run ends
    # 'cancelled'.
    CANCELLED = "cancelled"
    # The lease is, or may be, lost: another attempt may own the run, nothing more is written.
    LEASE_LOST = "lease_lost"
    # The worker drained past its grace: the run is released back to the queue.
    SHUTDOWN = "shutdown"
    # The database's clock says the attempt passed its timeout: it ends as a failure, reason
    # 'timeout', and is retried like any failure.
    TIMEOUT = "timeout"
    # The database's clock says the run passed its deadline: it ends failed, not retried.
    DEADLINE = "deadline_exceeded"


class Slot:
    """A run in progress, and the only writer of its state. Callers use the transitions:

    - `start(coro)`: the run's task runs `coro` (once);
    - `request_cancel()`: no stop yet and not finishing → CANCELLED;
    - `expire(reason)`: likewise → TIMEOUT or DEADLINE (the handler sees a cancellation);
    - `abandon(cancel_task=)`: the lease is lost → LEASE_LOST (from any other stop, once);
    - `shut_down()`: no stop yet and not finishing → SHUTDOWN (a drain past its grace);
    - `finish(forced=)`: the outcome is being written (the heartbeat must not take that for a
      lost lease, and no later stop applies), by the handler's task or, `forced`, by the
      worker in its place (past the cancel grace); once: the other writer's is dropped;
    - `give_up()`: a thread of the run cannot be stopped: the worker exits and it dies with it.

    Each returns whether it changed anything where a caller needs to know. All callers run on
    the worker's one event loop, so no locking is needed.
    """

    __slots__ = ("_cancel_seen", "_deadline", "_finishing", "_forced", "_given_up", "_stop",
                 "_task", "claimed", "control", "due", "extra", "started")

    def __init__(self, claimed: ClaimedRun, control: RunControl, *, deadline: float,
                 extra: dict[str, str]) -> None:
        self.claimed = claimed
        self.control = control
        # Log fields of this run (run, tenant, worker).
        self.extra = extra
        self._task: asyncio.Task[None] | None = None
        self._stop: StopReason | None = None
        self._finishing = False
        self._forced = False
        self._given_up = False
        self._cancel_seen: float | None = None
        self._deadline = deadline
        self.renew(deadline)
        # Monotonic time at which the attempt's timeout or the run's deadline comes, by the
        # database's clock at the claim (inf: neither): the heartbeat is asked then.
        self.due = math.inf
        # When the attempt started here (the loop's clock): its duration's start.
        self.started = control.loop.time()

    # -- state (read-only outside) -----------------------------------------------------------

    @property
    def task(self) -> asyncio.Task[None]:
        assert self._task is not None, "a slot's task exists once it is started"
        return self._task

    @property
    def deadline(self) -> float:
        """Monotonic time after which the lease may have expired in the database."""
        return self._deadline

    @property
    def stop_reason(self) -> StopReason | None:
        return self._stop

    @property
    def cancel_seen(self) -> float | None:
        """Monotonic time at which the worker acted on the run's cancel (None: it did not)."""
        return self._cancel_seen

    @property
    def finishing(self) -> bool:
        """The outcome is being written, or the run committed a durable wait (it is 'waiting'
        in the database: no lease to renew or lose, no stop to apply)."""
        return self._finishing or self.control.suspended

    @property
    def forced(self) -> bool:
        """The worker writes (or wrote) the run's end in its handler's place: the slot is
        freed once that write is done, not when the handler's task ends."""
        return self._forced

    @property
    def given_up(self) -> bool:
        """The worker gave up waiting for the run's threads: it exits, and they end with it."""
        return self._given_up

    @property
    def threads_running(self) -> bool:
        return self.control.threads.running

    # -- transitions -------------------------------------------------------------------------

    def start(self, coro: Coroutine[Any, Any, None]) -> None:
        if self._task is not None:
            coro.close()
            raise RuntimeError(f"the slot of run {self.claimed.id} was started already")
        self._task = self.control.loop.create_task(coro, name=f"run-{self.claimed.id}")

    def renew(self, deadline: float) -> None:
        """The lease may now run out at `deadline` (monotonic): the run's tools see it too."""
        self._deadline = deadline
        self.control.renew(deadline)

    def request_cancel(self) -> bool:
        """Cancel the run's task; False if it is already stopping or its outcome is written."""
        if self._stop is not None or self.finishing:
            return False
        self._stop = StopReason.CANCELLED
        self._cancel_seen = time.monotonic()
        self.control.cancel()
        self.task.cancel()
        return True

    def expire(self, reason: StopReason) -> bool:
        """The attempt's time is up (TIMEOUT or DEADLINE): cancel its task as a cancel does;
        False if it is already stopping or its outcome is written."""
        if self._stop is not None or self._finishing:
            return False
        self._stop = reason
        self.control.cancel()
        self.task.cancel()
        return True

    def abandon(self, *, cancel_task: bool = True) -> bool:
        """The lease is (or may be) lost: every later write of the attempt is fenced, and its
        task is cancelled unless `cancel_task` is False (it is ending by itself), or its
        outcome is being written (by the task itself: the handler is done, and the write,
        fenced now, ends soon). Cancelled there, the task would free the slot while the
        outcome writer's batch in flight already counted it freed for its refill: one slot,
        two runs. False if the lease was already given up."""
        if self._stop is StopReason.LEASE_LOST:
            return False
        self._stop = StopReason.LEASE_LOST
        self.control.lose()
        if cancel_task and not (self._finishing and not self._forced):
            self.task.cancel()
        return True

    def shut_down(self) -> bool:
        """The worker drains past its grace: the run is to be released. A plain handler gets
        no CancelledError: its next *_sync call refuses. False if it was stopping already."""
        if self._stop is not None or self.finishing:
            return False
        self._stop = StopReason.SHUTDOWN
        self.control.close("the worker is shutting down")
        self.task.cancel()
        return True

    def finish(self, *, forced: bool = False) -> bool:
        """Whether the caller writes the attempt's outcome: False if it is written already."""
        if self._finishing:
            return False
        self._finishing = True
        self._forced = forced
        return True

    def give_up(self) -> None:
        self.control.close("its worker is exiting")
        self._given_up = True


class Slots:
    """The worker's slots. A slot enters with `add` and leaves only through `vacate`, which
    removes that very slot. A later attempt of the same run, claimed again by this worker after
    a lost lease, has a slot of its own, and the earlier one keeps its place until it ends: its
    task (or a thread that cannot be stopped) still runs, so it counts against the worker's
    concurrency, and the stuck-thread check and the drain still see it (the runner gives it up
    as lost at once); the run's notices (`get`) go to the newest attempt."""

    def __init__(self) -> None:
        self._by_id: dict[uuid.UUID, Slot] = {}
        # Earlier attempts of runs this worker claimed again, still ending (rare: usually none).
        self._superseded: list[Slot] = []

    def __len__(self) -> int:
        return len(self._by_id) + len(self._superseded)

    def __iter__(self) -> Iterator[Slot]:
        """A snapshot: the table may change while the caller goes through it."""
        return iter([*self._by_id.values(), *self._superseded])

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._by_id

    def get(self, run_id: uuid.UUID) -> Slot | None:
        """The slot of the run's newest attempt here."""
        return self._by_id.get(run_id)

    def holds(self, slot: Slot) -> bool:
        return self._by_id.get(slot.claimed.id) is slot or slot in self._superseded

    def add(self, slot: Slot) -> None:
        earlier = self._by_id.get(slot.claimed.id)
        if earlier is not None:
            self._superseded.append(earlier)
        self._by_id[slot.claimed.id] = slot

    def vacate(self, slot: Slot) -> bool:
        """Free `slot`'s place; False if it had left already."""
        if self._by_id.get(slot.claimed.id) is slot:
            del self._by_id[slot.claimed.id]
            return True
        if slot in self._superseded:
            self._superseded.remove(slot)
            return True
        return False
