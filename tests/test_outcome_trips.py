"""A batch of outcomes and the refill claim riding on it cost one round trip (BEGIN, the
finishes, the serial keys' release, the claim and COMMIT behind one Sync: W1's hot path), and
the refill's runs are handed over only after COMMIT."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import uuid
from typing import Any

import psycopg
import pytest

import runpool
from runpool.claiming import ClaimedRun, PendingClaim, Statements, claim, claim_statements
from runpool.db import aconnect, connect, one_trip
from runpool.enqueue import enqueue
from runpool.outcomes import OutcomeWriter, finish_params, from_result
from runpool.pools import open_pool
from runpool.queries import QUERIES
from runpool.trips import Trip

from .helpers import live_workers, running_pool, status_of, until, wait_for


class _Refill:
    """Claims up to one noop run per batch; records what it was handed, and whether the
    claim had committed by then."""

    def __init__(self) -> None:
        self.worker_id = uuid.uuid4()
        self.handed: list[ClaimedRun] = []
        self.committed: list[bool] = []
        self.conn: psycopg.AsyncConnection[Any] | None = None

    def capacity(self, freed: int) -> int:
        return 1

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        # A worker session's batch is a trip (runpool.trips): its connection is the one asked.
        self.conn = conn.connection if isinstance(conn, Trip) else conn
        return await claim_statements(conn, limit=limit, worker_id=self.worker_id,
                                      lease_seconds=30, handlers=["noop"])

    def started(self, claimed: list[ClaimedRun], sent: float) -> None:
        assert self.conn is not None
        self.committed.append(
            self.conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE)
        self.handed.extend(claimed)


# The runs' statuses, by id.
STATUSES = "SELECT id, status FROM runpool.runs WHERE id = ANY(%s)"


def _statuses(conn: psycopg.Connection, *ids: uuid.UUID) -> dict[uuid.UUID, str]:
    return dict(conn.execute(STATUSES, (list(ids),)).fetchall())


async def _claimed(dsn: str, worker_id: uuid.UUID, limit: int = 1) -> list[ClaimedRun]:
    """Up to `limit` noop runs claimed for `worker_id`, as a worker's claim takes them."""
    async with await aconnect(dsn, autocommit=True) as c:
        return await claim(c, limit=limit, worker_id=worker_id, lease_seconds=30,
                           handlers=["noop"])


def _round_trips(trace: str) -> int:
    """The times the server's messages follow the client's in a libpq protocol trace."""
    sides = [f[1] for f in (line.split("\t") for line in trace.splitlines())
             if len(f) > 1 and f[1] in ("F", "B")]
    return sum(1 for pair in itertools.pairwise(sides) if pair == ("F", "B"))


def _statements(trace: str) -> int:
    """The statements the client sent in a libpq protocol trace (one Bind each)."""
    return sum(1 for line in trace.splitlines() if "\tF\t" in line and "\tBind\t" in line)


def _queries(trace: str) -> int:
    """The simple-protocol queries the client sent in a libpq protocol trace."""
    return sum(1 for line in trace.splitlines() if "\tF\t" in line and "\tQuery\t" in line)


async def _finish_traced(dsn: str, refill: _Refill, *, pinned: bool = False
                         ) -> tuple[str | None, int, int, int]:
    """Claim one run, then write its outcome through an OutcomeWriter whose batch refills:
    the run's new status, the batch's protocol round trips, statements (Binds) and simple
    queries (`pinned`: the writer is told its pool's sessions are worker sessions, whose
    batches are trips of the statements the session prepared on its first trip, made here
    before the trace starts)."""
    (first,) = await _claimed(dsn, refill.worker_id)
    pool = await open_pool(dsn, size=1, name="test-outcome-trips")
    try:
        writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill,
                               via="prepared" if pinned else "pipeline")
        async with pool.connection() as conn:  # the pool's one connection, traced throughout
            traced = conn
            if pinned:
                warm = Trip(conn)
                await warm.execute(QUERIES["touch_worker"], {"worker_id": uuid.uuid4()})
                await warm.send()
        with tempfile.TemporaryFile("w+") as trace:
            traced.pgconn.trace(trace.fileno())
            writing = asyncio.create_task(writer.run())
            try:
                status = await asyncio.wait_for(
                    writer.submit(from_result(first.id, first.attempt, {"ok": 1},
                                              max_bytes=1 << 20), serial=True), 30)
            finally:
                writing.cancel()
                traced.pgconn.untrace()
            trace.seek(0)
            text = trace.read()
            return status, _round_trips(text), _statements(text), _queries(text)
    finally:
        await pool.close()


def test_outcome_batch__with_its_refill_is_one_round_trip(
        conn: psycopg.Connection, dsn: str) -> None:
    first = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    second = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    refill = _Refill()
    # 14 statements: BEGIN, JIT off, the finishes, the serial keys' three, the claim's seven,
    # COMMIT.
    assert asyncio.run(_finish_traced(dsn, refill)) == ("succeeded", 1, 14, 0)
    # The refill claimed the serial key's next run, released by the same transaction, and it
    # was handed over once the transaction had committed.
    assert [c.id for c in refill.handed] == [second]
    assert refill.committed == [True]
    assert _statuses(conn, first, second) == {first: "succeeded", second: "running"}


class _FailingRefill(_Refill):
    """A refill whose claim the server cancels (57014, which looks transient) after the
    batch's finishes were sent."""

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        await conn.execute("SET LOCAL statement_timeout = 1")
        await conn.execute("SELECT pg_sleep(1)")
        return await super().statements(conn, limit)


class _RefusedRefill(_Refill):
    """A refill whose claim the database refuses for good (22012, not transient)."""

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        await conn.execute("SELECT 1 / 0")
        return await super().statements(conn, limit)


@pytest.mark.parametrize("refill_kind", [_FailingRefill, _RefusedRefill])
@pytest.mark.parametrize("pinned", [False, True])
def test_outcome_batch__a_failing_refill_does_not_hold_the_outcomes_back(
        conn: psycopg.Connection, dsn: str, pinned: bool, refill_kind: type[_Refill]) -> None:
    """Rolled back (pinned: the Sync ended the failed implicit transaction), the batch went
    again without its refill, whether the refill's failure looked transient or not: no
    outcome is blamed for it (an attack saw a succeeded run recorded outcome_rejected)."""
    first = runpool.enqueue(conn, "acme", "noop")
    second = runpool.enqueue(conn, "acme", "noop")
    refill = refill_kind()
    status, _, _, _ = asyncio.run(_finish_traced(dsn, refill, pinned=pinned))
    assert status == "succeeded"
    assert (refill.handed, refill.committed) == ([], [])
    assert _statuses(conn, first, second) == {first: "succeeded", second: "queued"}


def test_outcome_batch__a_worker_sessions_batch_is_one_simple_query(
        conn: psycopg.Connection, dsn: str) -> None:
    """A worker session pins read committed: the batch is one simple query's implicit
    transaction, without BEGIN and COMMIT, of 11 EXECUTEs of the statements the session
    prepared (runpool.trips): the finishes, the serial keys' three, and the claim's seven (its
    reap's three, promote_due, wake_due, lock_tenants, claim_runs). No Bind at all."""
    first = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    second = runpool.enqueue(conn, "acme", "noop", serial_key="k")
    refill = _Refill()
    assert asyncio.run(_finish_traced(dsn, refill, pinned=True)) == ("succeeded", 1, 0, 1)
    assert [c.id for c in refill.handed] == [second]
    assert refill.committed == [True]
    assert _statuses(conn, first, second) == {first: "succeeded", second: "running"}


async def _finish_then_raise(dsn: str, run: uuid.UUID, attempt: int) -> bool:
    """A worker session's pinned trip that sent a finish and then raised: whether its
    connection was closed."""
    pool = await open_pool(dsn, size=1, name="test-outcome-trips")
    try:
        async with pool.connection() as c:
            try:
                async with one_trip(c, pinned=True):
                    await c.execute(QUERIES["finish_runs"], finish_params(
                        [from_result(run, attempt, {"ok": 1}, max_bytes=1 << 20)]))
                    await c.execute("SELECT pg_sleep(0.05)")
                    raise RuntimeError("a bug of ours, mid-trip")
            except RuntimeError:
                pass
            return c.closed
    finally:
        await pool.close()


def test_one_trip__a_pinned_trip_that_raises_commits_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    """Without BEGIN, the pipeline's Sync would commit what the body sent before it raised:
    a finish without the claim riding with it. The connection is closed instead."""
    runpool.enqueue(conn, "acme", "noop")
    conn.commit()

    (run,) = asyncio.run(_claimed(dsn, uuid.uuid4()))
    assert asyncio.run(_finish_then_raise(dsn, run.id, run.attempt)) is True
    assert _statuses(conn, run.id) == {run.id: "running"}


class _CountingRefill(_Refill):
    """Claims nothing; records the slots each batch said it freed."""

    def __init__(self) -> None:
        super().__init__()
        self.freed: list[int] = []

    def capacity(self, freed: int) -> int:
        self.freed.append(freed)
        return 0


def test_outcome_batch__a_busy_outcome_frees_its_slot_for_a_refill_once(
        conn: psycopg.Connection, dsn: str) -> None:
    """An outcome answered 'busy' (its row held by a session) keeps its slot and its live
    lease, and is written again later: only its first write may count its slot as freed for
    the batch's refill. Counting every retry let a worker of 5 slots hold 90 leases (an
    attack on the quota margin, migration 0025, whose premise is at most twice the slots)."""
    run_id = runpool.enqueue(conn, "acme", "noop")
    refill = _CountingRefill()

    async def main() -> str | None:
        (run,) = await _claimed(dsn, refill.worker_id)
        pool = await open_pool(dsn, size=1, name="test-outcome-busy")
        hostile = await aconnect(dsn)
        try:
            await hostile.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR UPDATE",
                                  (run_id,))
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill)
            writing = asyncio.create_task(writer.run())
            try:
                done = asyncio.ensure_future(writer.submit(
                    from_result(run.id, run.attempt, {"ok": 1}, max_bytes=1 << 20),
                    serial=False))
                await until(lambda: len(refill.freed) >= 3, "the first write and two retries",
                            interval=0.01)
                await hostile.commit()
                return await asyncio.wait_for(done, 30)
            finally:
                writing.cancel()
        finally:
            await hostile.close()
            await pool.close()

    assert asyncio.run(main()) == "succeeded"
    assert len(refill.freed) >= 3
    assert refill.freed[0] == 1 and set(refill.freed[1:]) == {0}


def test_outcome_batch__a_waves_outcomes_go_in_one_batch(
        conn: psycopg.Connection, dsn: str) -> None:
    """Runs started together end a loop turn or so apart; the writer wakes at the first
    outcome and must take the rest of the wave too, not send it in a trip of its own (W1 at
    2 x 10 split a third of its trips 9 + 1 or 8 + 2, each trip ~0.5 ms of the worker's CPU)."""
    first = runpool.enqueue(conn, "acme", "noop")
    second = runpool.enqueue(conn, "acme", "noop")
    refill = _CountingRefill()

    async def main() -> list[str | None]:
        runs = await _claimed(dsn, refill.worker_id, limit=2)
        pool = await open_pool(dsn, size=1, name="test-outcome-wave")
        try:
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill)
            writing = asyncio.create_task(writer.run())
            await asyncio.sleep(0)  # the writer waits for its first outcome

            async def run(r: ClaimedRun, turns: int) -> str | None:
                for _ in range(turns):  # a run whose end comes a loop turn later
                    await asyncio.sleep(0)
                return await writer.submit(from_result(r.id, r.attempt, {"ok": 1},
                                                       max_bytes=1 << 20))

            try:
                return list(await asyncio.wait_for(
                    asyncio.gather(run(runs[0], 0), run(runs[1], 1)), 30))
            finally:
                writing.cancel()
        finally:
            await pool.close()

    assert asyncio.run(main()) == ["succeeded", "succeeded"]
    assert refill.freed == [2]  # one batch of both
    assert set(_statuses(conn, first, second).values()) == {"succeeded"}


def test_outcome_batch__a_cancelled_submitters_outcome_frees_no_slot(
        conn: psycopg.Connection, dsn: str) -> None:
    """A run stopped while its outcome waits in the writer's queue (its lease lost) leaves its
    slot at once, and the worker counts that slot free: the outcome, still written, must not
    count it freed a second time for the batch's refill."""
    run_id = runpool.enqueue(conn, "acme", "noop")
    refill = _CountingRefill()

    async def main() -> None:
        (run,) = await _claimed(dsn, refill.worker_id)
        pool = await open_pool(dsn, size=1, name="test-outcome-cancelled")
        try:
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill)
            submitter = asyncio.ensure_future(writer.submit(
                from_result(run.id, run.attempt, {"ok": 1}, max_bytes=1 << 20)))
            await until(lambda: writer._queue.qsize() == 1, "the outcome queued",
                        interval=0.01)
            submitter.cancel()
            writing = asyncio.create_task(writer.run())
            try:
                # (Read through the test's own connection: the writer is cancelled only
                # once its batch committed.)
                await until(lambda: _statuses(conn, run_id) == {run_id: "succeeded"},
                            "the outcome written", interval=0.01)
            finally:
                writing.cancel()
        finally:
            await pool.close()

    asyncio.run(main())  # the outcome is written all the same
    assert refill.freed == [0]


def test_refill_and_claim_loop__a_worker_never_holds_more_runs_than_its_concurrency(
        dsn: str) -> None:
    """Short runs arriving in bursts, each burst while the last one's runs end: an outcome
    batch's refill and the claim loop (woken by the burst's doorbell, or a slot freed) both
    counted the worker's empty slots, and both filled them (an attack pass: 10 runs at once at
    concurrency 8, no fault needed). Counted on the database's clock: a run is held from its
    claim (started_at) to its outcome's commit (finished_at; a refill's claims share that
    commit's instant, after it)."""
    with connect(dsn, autocommit=True) as conn, running_pool(dsn, concurrency=8):
        wait_for(lambda: live_workers(conn), what="the worker")
        for _ in range(60):
            with conn.transaction():
                burst = [enqueue(conn, "acme", "sleep", {"seconds": 0.1}) for _ in range(10)]
            first = burst[0]
            wait_for(lambda: status_of(conn, first) == "succeeded",  # noqa: B023 (awaited here)
                     interval=0.005, what="the burst's first run")
        wait_for(lambda: not conn.execute("SELECT 1 FROM runpool.runs WHERE status <> "
                                          "'succeeded' LIMIT 1").fetchone(), what="all ended")
        held = conn.execute("SELECT started_at, finished_at FROM runpool.runs").fetchall()
    changes = sorted([(s, 1) for s, _ in held] + [(f, -1) for _, f in held])
    at_once = list(itertools.accumulate(d for _, d in changes))
    assert max(at_once) <= 8, max(at_once)
