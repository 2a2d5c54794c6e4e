"""Many followers in one process over one LISTEN connection and a few pooled readers.

`follow()` LISTENs on a connection of its own per follower. That is right for one client, and
wrong for a service that streams runs to many: PostgreSQL wakes every listening session of a
database at every commit that notifies (async.c signals each listener that is behind the
queue's head, whatever its channels), so N followers cost the server N wake-ups per doorbell,
and each holds a connection. W12 (100 followers, 400 doorbells/s, 2 cores): a follower heard
a message 15 ms after its commit at p50 and 138 ms at p99, against 1 ms for a lone follower.

A FollowHub LISTENs on each followed run's channel on one connection and rings the followers
of a run when its doorbell comes. Their reads wait in one line, in the order they were asked
for; `readers` tasks, each with a pooled connection, read for up to BATCH of them in one
statement (live.EVENTS reads any number of runs). So the followers whose doorbells rang
together cost one statement, not one each (W12 through a hub: p50 2-3 ms, p99 7-20 ms). Each
follower has at most one read waiting; a follower still catching up reads alone, and a read
for many brings no more messages than one follower's page (live.page_size). A run whose
doorbell rings past FLOOD times a second, or past BUSY_RUN while the hub hears past HUB_FLOOD
(a forger's NOTIFY), is not listened to for a while, and the hub listens on a fresh
connection, past the flood's backlog: the muted run's followers poll fast meanwhile, and the
others' doorbells do not queue behind the flood.

A follower is rung once its channel is LISTENed to, so it reads what committed before then;
its first read happens at once, without waiting for the LISTEN. When the LISTEN connection
breaks, every follower is rung (a doorbell may have been lost), reads on its `poll` until the
connection is back (reconnected with a growing pause), and is rung again then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import deque
from collections.abc import AsyncGenerator, Iterable
from types import TracebackType
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg_pool import AsyncConnectionPool

from .db import aconnect, connection_options, named, set_up
from .deadlines import bounded
from .listener import NoiseLog
from .live import EVENTS, READ_SECONDS, RunEvent, Stream, channel, page_size, reads
from .live_io import aexecute
from .tasks import cancel_all

__all__ = ["FollowHub"]

# A read's reply to one follower: its rows, and the most messages a run that read brought.
Reply = tuple[list[tuple[Any, ...]], int]

logger = logging.getLogger("runpool.live")

# A run's channel, less the run id's 32 hex digits (live.channel).
PREFIX: Final = channel(uuid.UUID(int=0))[:-32]
# The most channels one LISTEN (or UNLISTEN) statement names: a burst of new followers waits
# for one statement, not one each, and no statement grows without bound.
CHANNELS_PER_STATEMENT: Final = 500
# Pause before reconnecting a broken LISTEN connection, growing to RECONNECT_MAX.
RECONNECT_PAUSE: Final = 0.2
RECONNECT_MAX: Final = 5.0
# Connections the reads share, unless given (each with a task reading for the followers).
READERS: Final = 4
# The most followers one read serves: the runs whose doorbells rang together are read in one
# statement (W12's 100 followers, rung in step: ~100 statements of ~0.6 ms of server time
# each). Only followers that have caught up are read together, each run's messages split
# into one follower's page (live.page_size): a follower catching up reads alone, a whole
# page at a time, as follow() does (together, 40 followers of a run of 2,000 tool calls read
# them over and over in small pages: 17.6 s against 1.9 s alone, and 32 followers of runs
# of 1 MB messages held 3 GB at once).
BATCH: Final = 32
# A run whose doorbell rings more than FLOOD times in one second is not listened to for
# MUTE_SECONDS, and its followers read every MUTED_POLL seconds meanwhile. Any login may
# NOTIFY a run's channel, and one connection hears every followed run's doorbells in order:
# a forger's 500,000 a second on one followed run (Python reads ~50,000 a second) held every
# other run's doorbells back for seconds; UNLISTENed, the server skips them. A run's own
# writes ring it far less (an attack's fastest real runs, a tool loop and 1,500 messages
# with no pause, were muted at 200 a second); one ringing faster is followed at MUTED_POLL's
# pace until it calms down.
FLOOD: Final = 1000
# ... and while the hub hears more than HUB_FLOOD doorbells in a second in all (a forger's
# flood spread over many followed runs, each under FLOOD: 50 runs at 7,000 a second held
# other runs' doorbells back for 24 s), each run heard more than BUSY_RUN times in it. Real
# runs ring a hub a few thousand times a second in all.
HUB_FLOOD: Final = 20_000
BUSY_RUN: Final = 50
MUTE_SECONDS: Final = 10.0
MUTED_POLL: Final = 0.1
# Seconds between two fresh LISTEN connections asked for by floods (_listen_on): a flood
# re-muted every MUTE_SECONDS on many runs must not keep the hub reconnecting.
FRESH_EVERY: Final = 1.0
# What a follow() waiting for a read when the hub closes raises (RuntimeError).
CLOSED: Final = "the FollowHub was closed"
# The readers' application_name; the LISTEN connection's is it + "-listen".
NAME: Final = "runpool-follow"


class FollowHub:
    """Follow many runs in one process: `async with FollowHub(dsn) as hub:`, then
    `async for event in hub.follow(run_id, after)` per follower, as many at once as needed.
    Each follow() is `runpool.follow`'s contract (events exactly once, in commit order, then
    the end once the run is terminal; NotFound; `tenant`; `poll` as the fallback) with no
    connection of its own: a failed read raises psycopg.OperationalError, or DatabaseTimeout
    when no reader is free within READ_SECONDS; resume with after=<the last seq seen>."""

    def __init__(self, dsn: str, *, readers: int = READERS, name: str = NAME) -> None:
        self._dsn, self._name = dsn, name
        self._pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=readers, name=name, open=False, max_idle=300,
            kwargs={**connection_options(dsn), **named(dsn, {}, name)}, configure=set_up)
        # The bells of each followed run (one per follower), and the runs LISTENed to on the
        # current connection.
        self._bells: dict[uuid.UUID, set[asyncio.Event]] = {}
        self._listening: set[uuid.UUID] = set()
        self._changed = asyncio.Event()  # a run to LISTEN or UNLISTEN
        self._task: asyncio.Task[None] | None = None
        # The reads followers wait for, in the order they asked, and the tasks making them.
        self._wanted: deque[tuple[Stream, asyncio.Future[Reply]]] = deque()
        self._work = asyncio.Event()  # a read is wanted
        self._readers: list[asyncio.Task[None]] = []
        self._closed = False
        # Doorbells heard per run in the current second (since `_second`), and the runs not
        # listened to until when (the loop's clock) for their doorbells' flood.
        self._counts: dict[uuid.UUID, int] = {}
        self._second = 0.0
        self._total = 0  # doorbells heard in the current second, all runs
        self._muted: dict[uuid.UUID, float] = {}
        # A run was muted: listen on a fresh connection (_listen_on); the last one's time.
        self._fresh = False
        self._fresh_at = -FRESH_EVERY
        self._lost = NoiseLog()
        self._floods = NoiseLog()
        # Doorbells heard, LISTEN connections made (the tests' view).
        self.heard = 0
        self.connections = 0

    @property
    def followers(self) -> int:
        """How many follow() streams are open."""
        return sum(len(bells) for bells in self._bells.values())

    async def open(self) -> None:
        """Open the readers (raising if the database cannot be reached) and start listening."""
        await self._pool.open(wait=True, timeout=30)
        self._task = asyncio.create_task(self._listen_forever(), name="runpool-follow-hub")
        self._readers = [asyncio.create_task(self._reader(), name="runpool-follow-hub-reader")
                         for _ in range(self._pool.max_size)]

    async def close(self) -> None:
        """Stop listening and reading; every follow() still open raises RuntimeError."""
        self._closed = True
        self._ring(list(self._bells))  # (the followers waiting for a doorbell raise now)
        await cancel_all([t for t in (self._task, *self._readers) if t is not None])
        self._task, self._readers = None, []
        while self._wanted:
            _answer(self._wanted.popleft()[1], exc=RuntimeError(CLOSED))
        await self._pool.close()

    async def __aenter__(self) -> FollowHub:
        await self.open()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def follow(self, run_id: uuid.UUID | str, after: int = 0, *, poll: float = 1.0,
                     tenant: str | None = None) -> AsyncGenerator[RunEvent, None]:
        """The run's events after seq `after` (see the class)."""
        stream = Stream(run_id, after, poll, tenant)
        if self._task is None:
            raise RuntimeError("FollowHub.follow outside open() ... close()")
        bell = self._subscribe(stream.run_id)
        try:
            while True:
                bell.clear()  # before the read: a doorbell during it makes another
                events, then = stream.take(*await self._read(stream))
                for event in events:
                    yield event  # (no connection held while the caller takes it)
                if then == "end":
                    return
                if then == "wait":
                    # (asyncio.timeout, not wait_for: Python 3.11's wait_for swallows a cancel
                    # that comes as the bell rings, and the follower went on: 168 of 1,000
                    # cancelled followers of a run rung 150 times a second.)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(self._poll(stream)):
                            await bell.wait()
        finally:
            self._unsubscribe(stream.run_id, bell)

    async def _read(self, stream: Stream) -> Reply:
        """The stream's rows of the next read, made with the reads wanted meanwhile, and the
        page size that read had."""
        if self._closed:
            raise RuntimeError(CLOSED)
        answer: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._wanted.append((stream, answer))
        self._work.set()
        return await answer

    async def _reader(self) -> None:
        """One of `readers`: reads for up to BATCH waiting followers at a time, in turn; a
        follower still catching up (its first read, or its last brought a full page) alone."""
        while True:
            batch: list[tuple[Stream, asyncio.Future[Reply]]] = []
            while self._wanted and len(batch) < BATCH:
                stream, answer = self._wanted[0]
                if answer.done():  # (a follower gone meanwhile)
                    self._wanted.popleft()
                    continue
                if not stream.caught_up:
                    if not batch:
                        batch.append(self._wanted.popleft())
                    break
                batch.append(self._wanted.popleft())
            if not batch:
                self._work.clear()
                await self._work.wait()
                continue
            try:
                await self._serve(batch)
            except BaseException:  # (closed mid-read: its followers must not wait forever)
                for _, answer in batch:
                    _answer(answer, exc=RuntimeError(CLOSED))
                raise

    async def _serve(self, batch: list[tuple[Stream, asyncio.Future[Reply]]]) -> None:
        """Read for these followers in one statement, and answer each with its rows."""
        try:
            rows = await self._rows([stream for stream, _ in batch])
        except Exception as exc:
            if len(batch) == 1:
                _answer(batch[0][1], exc=exc)
                return
            # Whatever failed it, it costs the others no more than a read each alone.
            for stream, answer in batch:
                try:
                    _answer(answer, (await self._rows([stream]), page_size(1)))
                except Exception as alone:
                    _answer(answer, exc=alone)
            return
        mine: list[list[tuple[Any, ...]]] = [[] for _ in batch]
        for row in rows:
            mine[row[0] - 1].append(row)
        size = page_size(len(batch))
        for (_, answer), its in zip(batch, mine, strict=True):
            _answer(answer, (its, size))

    async def _rows(self, streams: list[Stream]) -> list[tuple[Any, ...]]:
        async with bounded(self._pool, READ_SECONDS) as conn:
            cur = await aexecute(conn, READ_SECONDS, EVENTS, reads(streams))
            return await cur.fetchall()

    def _subscribe(self, run_id: uuid.UUID) -> asyncio.Event:
        bell = asyncio.Event()
        if run_id not in self._bells:
            # (Even when its channel is LISTENed to: an UNLISTEN of it may be on its way.)
            self._changed.set()
        self._bells.setdefault(run_id, set()).add(bell)
        return bell

    def _unsubscribe(self, run_id: uuid.UUID, bell: asyncio.Event) -> None:
        bells = self._bells.get(run_id)
        if bells is not None:
            bells.discard(bell)
            if not bells:
                del self._bells[run_id]
                self._changed.set()

    def _ring(self, run_ids: Iterable[uuid.UUID]) -> None:
        for run_id in run_ids:
            for bell in self._bells.get(run_id, ()):
                bell.set()

    async def _listen_forever(self) -> None:
        pause = RECONNECT_PAUSE
        while True:
            try:
                conn = await aconnect(self._dsn, autocommit=True, name=f"{self._name}-listen",
                                      listen=True)
            except psycopg.OperationalError as exc:
                self._say_lost(exc)
            else:
                self.connections += 1
                self._listening = set()
                pause = RECONNECT_PAUSE
                fresh = False
                try:
                    async with conn:
                        await self._listen_on(conn)
                    fresh = True
                except psycopg.Error as exc:
                    self._say_lost(exc)
                self._listening = set()
                self._ring(list(self._bells))  # a doorbell may have been lost meanwhile
                if fresh:
                    continue
            await asyncio.sleep(pause)
            pause = min(pause * 2, RECONNECT_MAX)

    async def _listen_on(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN and hear on `conn` until a flood asks for a fresh connection (returns).

        Why a fresh one: the server sends a session all it has queued for it before it reads
        the session's next statement, so an UNLISTEN of a flooded run waits behind the flood's
        backlog (an attack: 8 s, 1.4 million doorbells read, with 50 runs flooded), while a
        new session starts at the queue's head. At most one a FRESH_EVERY: until the next is
        due, this one hears on and sends nothing (an UNLISTEN would wait behind the flood)."""
        loop = asyncio.get_running_loop()
        while True:
            if not self._fresh:
                await self._sync(conn)
            elif loop.time() >= self._fresh_at + FRESH_EVERY:
                self._fresh, self._fresh_at = False, loop.time()
                return
            else:
                self._changed.clear()  # (the fresh connection's first _sync sees all)
            await self._hear(conn)

    def _say_lost(self, exc: Exception) -> None:
        count = self._lost.count()
        if count:
            logger.warning("follow hub: no LISTEN connection (%d times since the last line):"
                           " %r; its followers read on their poll meanwhile", count, exc,
                           extra={"action": "follow_hub_listen_lost"})

    async def _sync(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """LISTEN to the runs followed now and not muted, UNLISTEN the others; ring the newly
        heard (a write may have committed between their first read and the LISTEN)."""
        self._changed.clear()
        now = asyncio.get_running_loop().time()
        for run_id, until in list(self._muted.items()):
            if until <= now:
                del self._muted[run_id]
        add = [r for r in self._bells if r not in self._listening and r not in self._muted]
        drop = [r for r in self._listening if r not in self._bells or r in self._muted]
        for verb, runs in (("LISTEN", add), ("UNLISTEN", drop)):
            for at in range(0, len(runs), CHANNELS_PER_STATEMENT):
                part = runs[at:at + CHANNELS_PER_STATEMENT]
                await aexecute(conn, READ_SECONDS, sql.SQL("; ").join(
                    sql.SQL(verb + " {}").format(sql.Identifier(channel(r))) for r in part))
                if verb == "LISTEN":
                    self._listening.update(part)
                    self._ring(part)
                else:
                    self._listening.difference_update(part)

    async def _hear(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Ring the followers of each doorbell heard, until a run is to be (UN)LISTENed.
        Doorbells that come while a LISTEN runs wait in psycopg's backlog for the next."""
        reading = asyncio.ensure_future(self._dispatch(conn))
        changed = asyncio.ensure_future(self._changed.wait())
        # (Until the first muted run is to be heard again, or a fresh connection is due, at
        # most.)
        until = min([*self._muted.values(),
                     *([self._fresh_at + FRESH_EVERY] if self._fresh else [])], default=None)
        timeout = None if until is None else max(0.0, until - asyncio.get_running_loop().time())
        try:
            await asyncio.wait((reading, changed), timeout=timeout,
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (reading, changed):
                task.cancel()
            await asyncio.gather(changed, return_exceptions=True)
            with contextlib.suppress(asyncio.CancelledError):
                await reading  # its failure (the connection's) is raised here

    async def _dispatch(self, conn: psycopg.AsyncConnection[Any]) -> None:
        async for notice in conn.notifies():
            name = notice.channel
            if not name.startswith(PREFIX):
                continue
            try:
                run_id = uuid.UUID(hex=name[len(PREFIX):])
            except ValueError:
                continue
            self.heard += 1
            self._count(run_id)
            self._ring((run_id,))

    def _count(self, run_id: uuid.UUID) -> None:
        """Mute a run whose doorbell rings past FLOOD times in a second, or past BUSY_RUN
        while the hub hears past HUB_FLOOD in all."""
        now = asyncio.get_running_loop().time()
        if now - self._second >= 1.0:
            self._counts.clear()
            self._second, self._total = now, 0
        heard = self._counts[run_id] = self._counts.get(run_id, 0) + 1
        self._total += 1
        loud = heard > FLOOD or (self._total > HUB_FLOOD and heard > BUSY_RUN)
        if loud and run_id not in self._muted:
            self._muted[run_id] = now + MUTE_SECONDS
            self._fresh = True
            self._changed.set()
            count = self._floods.count()
            if count:
                logger.warning("follow hub: run %s's doorbell rang %d times in a second (%d in"
                               " all; %d runs muted since the last line): not listened to for"
                               " %g s; its followers read every %g s meanwhile", run_id, heard,
                               self._total, count, MUTE_SECONDS, MUTED_POLL,
                               extra={"action": "follow_hub_muted", "run_id": str(run_id)})

    def _poll(self, stream: Stream) -> float:
        """How long a follower waits for a doorbell before it reads anyway."""
        return min(stream.poll, MUTED_POLL) if stream.run_id in self._muted else stream.poll



def _answer(answer: asyncio.Future[Reply], rows: Reply | None = None, *,
            exc: BaseException | None = None) -> None:
    """Answer a follower's read, unless it is gone (its future cancelled)."""
    if answer.done():
        return
    if exc is not None:
        answer.set_exception(exc)
    elif rows is not None:
        answer.set_result(rows)
