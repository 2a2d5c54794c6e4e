"""Group commit of checkpoint writes: the writes of a worker's runs that wait at the same time
share one transaction, so thousands of runs in flight cost a commit per batch, not per write.

A write is `op(conn, try_number)`, one fenced statement of runpool.checkpoints (safe to
repeat: a later try reads back what an earlier one committed). While fewer than MAX_INFLIGHT
batches are in flight a write goes at once, alone (its batch statement on its own, in
autocommit: one statement, as it would go without this module); past that, the writes
arriving meanwhile wait and go together in the next batch (how a batch goes, and what a
failure in it does: runpool.commit_sends).

No write waits for a held run row in a lane: a write whose run row another transaction holds
(a heartbeat for a moment; a tenant's own transaction on its run, left open) is skipped by its
batch statement (up to MAX_SKIPS times, pausing between), or found held when its transaction
share-locks its run's row first (lane_locks.BEGIN_WRITES, SKIP LOCKED), and goes on alone in
a waiting lane (MAX_WAITING), where a row still held answers it with DatabaseTimeout, which
its caller repeats after a pause: it polls for the row (each poll one statement that waits for
nothing) without holding any lane, until its deadline. Any other lock (a tenant's usage
rollup row, which the worker's own batches hold for moments; a serial key a spawn takes)
waits briefly (lane_locks.LOCK_TIMEOUT). Repeats (which first wait for their earlier try) go in the
waiting lanes too. So no tenant's held rows slow another tenant's writes.

The writes of one run are serialised by the run (Run._write_lock): a run is in at most one
batch at a time, and a batch's row locks are of distinct runs, so batches never wait for each
other.
"""

from __future__ import annotations

import asyncio
import uuid
from collections import deque
from typing import Any, Final

from psycopg_pool import AsyncConnectionPool

from .batch_sends import Op, Statement, Write, answer
from .commit_sends import BatchSends, batchable
from .deadlines import again
from .doorbells import Doorbells
from .errors import DatabaseTimeout
from .lane_locks import locked
from .pooled import Route
from .trips import Via

__all__ = ["CommitGroup", "Statement"]


# Batches in flight at once before writes start to wait and group: few enough that a loaded
# worker's writes batch (W11: 2,000 runs in flight; 4 lanes made batches of ~3 writes and
# cost more server CPU per write, see README "Group commit"), and a pool's other users
# (claims, heartbeats, outcomes) keep connections. Nothing in a lane waits for a run row
# another transaction holds (a batch statement skips it; other writes share-lock their runs'
# rows first, skipping held ones; other locks wait at most LOCK_TIMEOUT), so a tenant holding
# its own rows open cannot hold a lane.
MAX_INFLIGHT: Final = 2
# Lanes of the writes that may wait for a held row (those a batch skipped or found held, and
# repeats): each alone, in a transaction of its own
# (lane_locks.locking_briefly); a row still held sends the write back to its caller, which
# polls (deadlines.again's backoff, up to 1 s) without holding a lane.
MAX_WAITING: Final = 2
# The most writes in one transaction: each holds its run's row (share-locked by the fence)
# until the commit, and a heartbeat skips a locked row, so a batch is kept short.
MAX_BATCH: Final = 64
# A group that committed BUSY_COMMITS batches in its last RATE_WINDOW seconds is loaded: its
# batches then ring their runs' doorbells after they commit (runpool.doorbells), not in their
# commit, where the notification lock would make each commit wait for the flush of the one
# before (W11: 1.5 backends waiting on that lock). Below it a write's ring costs no round trip
# more: with every write rung afterwards, W12's followers heard a write 3-7 ms after its
# commit instead of 1-3.
BUSY_COMMITS: Final = 15
RATE_WINDOW: Final = 0.1


class CommitGroup(BatchSends):
    """One per worker: checkpoint writes of all its runs, committed in groups under load."""

    def __init__(self, pool: AsyncConnectionPool, *, via: Via | Route = "prepared",
                 doorbells: Doorbells | None = None, busy_commits: int = BUSY_COMMITS
                 ) -> None:
        """`via`: how a batch of first tries goes (batch_sends.send_all): "prepared" on
        worker sessions, "functions" behind a pooler, "pipeline"; a worker's Route, shared
        with its claims, may fall back from "functions" to "pipeline". `doorbells`: what
        rings the runs of a loaded group's batches once they committed (checkpoints.batch_sql
        BATCH_EVENT), or one of the group's own; `busy_commits`: the commits in RATE_WINDOW
        that make the group loaded (0: always)."""
        super().__init__(pool, via=via, doorbells=doorbells)
        # First tries, batched in MAX_INFLIGHT lanes; and the writes that may wait for a held
        # row, each alone in MAX_WAITING lanes of their own.
        self._queue: deque[Write] = deque()
        self._waiting: deque[Write] = deque()
        self._inflight = 0
        self._inflight_waiting = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # Whether the group is loaded (_loaded), and when its window began with how many
        # commits made until then.
        self._busy_commits = busy_commits
        self._busy = busy_commits <= 0
        self._window = (0.0, 0)

    async def write(self, op: Op, seconds: float, *, what: str,
                    log: dict[str, str] | None = None,
                    statement: Statement | None = None, run_id: uuid.UUID | None = None
                    ) -> Any:
        """Run `op` in the next batch, again when it fails transiently, within `seconds`;
        `statement`, if given, is `op`'s first try as a statement (pipelined in a batch);
        `run_id`, the run whose row `op` locks: while that row stays held by another
        transaction, a poll only asks whether it still is (one cheap statement)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds

        held = False

        async def once(tries: int) -> Any:
            nonlocal held
            done: asyncio.Future[Any] = loop.create_future()
            # A repeat goes alone, in a short transaction of its own: it first waits for its
            # earlier try (store.SETTLED), and repeats come after cuts, where a long shared
            # transaction of them was cut again and again (backends killed every 30 ms: the
            # batch never committed); a try after a held row polls.
            w = Write(op, tries, deadline, done, statement if tries == 0 else None,
                      alone=tries > 0, run_id=run_id, held=held)
            (self._waiting if w.alone else self._queue).append(w)
            self._kick()
            try:
                return await done
            except DatabaseTimeout as exc:
                held = locked(exc.__cause__)
                raise

        return await again(once, seconds, what=what, log=log)

    def _kick(self) -> None:
        while self._waiting and self._inflight_waiting < MAX_WAITING:
            w = self._waiting.popleft()
            if not w.done.done():  # its caller gave up (cancelled): never sent
                self._start([w], waiting=True)
        now = asyncio.get_running_loop().time()
        while self._queue and self._inflight < MAX_INFLIGHT:
            batch: list[Write] = []
            while self._queue and len(batch) < MAX_BATCH:
                w = self._queue.popleft()
                if w.deadline <= now:  # past it while it paused or waited: not sent
                    answer(w, exc=DatabaseTimeout("the write did not go within its deadline"))
                elif not w.done.done():
                    batch.append(w)
            if not batch:
                return
            self._start(batch, waiting=False)

    def _start(self, batch: list[Write], *, waiting: bool) -> None:
        if waiting:
            self._inflight_waiting += 1
        else:
            self._inflight += 1
        task = asyncio.get_running_loop().create_task(self._flush(batch, waiting))
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._flushed(t, waiting))

    def _flushed(self, task: asyncio.Task[None], waiting: bool) -> None:
        self._tasks.discard(task)
        if waiting:
            self._inflight_waiting -= 1
        else:
            self._inflight -= 1
        self._kick()

    async def _flush(self, batch: list[Write], waiting: bool) -> None:
        # Bounded by its latest deadline, not its earliest: a write near its own (back from
        # its pauses) cut the whole batch short, and every other write in it went again (an
        # attack); one whose deadline passes meanwhile is answered when the batch ends.
        loop = asyncio.get_running_loop()
        left = max(max(w.deadline for w in batch) - loop.time(), 0.001)
        # Its batch statements ring their runs' doorbells in its commit unless the group is
        # loaded; then they are rung after it (see BUSY_COMMITS).
        ring = not self._loaded(loop.time())
        try:
            if len(batch) > 1:
                await self._together(batch, left, ring)
            elif not waiting and batchable(batch[0].statement):
                await self._single(batch[0], left, ring)
            else:
                await self._alone(batch[0], left, waiting)
        except BaseException as exc:
            for w in batch:
                answer(w, exc=exc)
            if not isinstance(exc, Exception):
                raise

    def _loaded(self, now: float) -> bool:
        """Whether the group committed BUSY_COMMITS batches in its last whole RATE_WINDOW (a
        window is judged when it has ended; one that ended long ago counts none)."""
        began, commits = self._window
        if self._busy_commits > 0 and now - began >= RATE_WINDOW:
            self._busy = (now - began < 2 * RATE_WINDOW
                          and self.commits - commits >= self._busy_commits)
            self._window = (now, self.commits)
        return self._busy

    def _requeue(self, batch: list[Write]) -> None:
        """The writes of a batch not answered yet (rolled back, or skipped), first in their
        queue again: those that may wait for a held row (alone) in the waiting lanes', and
        those a batch statement skipped after their pause."""
        left = [w for w in batch if not w.done.done()]
        self._waiting.extendleft(reversed([w for w in left if w.alone]))
        self._queue.extendleft(reversed([w for w in left if not w.alone and not w.pause]))
        loop = asyncio.get_running_loop()
        for w in left:
            if w.pause and not w.alone:
                loop.call_later(w.pause, self._resume, w)
                w.pause = 0.0

    def _resume(self, w: Write) -> None:
        self._queue.append(w)
        self._kick()
