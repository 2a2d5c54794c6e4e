"""A worker session's trips (runpool.trips): one simple query of EXECUTEs of the statements
the session prepared. User strings arrive unchanged, a refused statement commits nothing, a
session that lost its statements prepares them again, and a stateless (pooler) session keeps
psycopg's pipeline."""

from __future__ import annotations

import asyncio
import itertools
import tempfile
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import psycopg
import pytest

import runpool
from runpool.claiming import ClaimedRun, PendingClaim, Statements, claim, claim_statements
from runpool.db import aconnect
from runpool.outcomes import OutcomeWriter, finish_params, from_result
from runpool.pools import open_pool
from runpool.queries import QUERIES
from runpool.trips import HOT, Trip, Via, prepared_sql

from .helpers import claim_cancelled_after, run_row

IDLE = psycopg.pq.TransactionStatus.IDLE
# Strings that would end, or escape, a badly quoted literal (or a dollar-quoted one).
HOSTILE = ["it's", 'say "hi"', "back\\slash", "\\", "\\'", "'", "''", "$$", "$x$;",
           "'; DROP TABLE runpool.runs; --", "semi;colon", "E'\\x27'", "tab\there",
           "new\nline", "ünïcødé ☃ 𝄞 ‮rtl", "{a,b}", "NULL", "%(limit)s", "$1"]
OURS = "SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'runpool\\_%'"


def _hostile_json(i: int) -> dict[str, Any]:
    return {"text": HOSTILE[i % len(HOSTILE)], "all": HOSTILE, "quote": '"', "bs": "\\",
            "not a NUL": "\\u0000", "nested": {"'": ["$$", "\\\"", None, 1.5, -7]}}


def _trace_counts(trace: str) -> dict[str, int]:
    """Round trips (the server answering after the client spoke) and the messages the client
    sent, by type, in a libpq protocol trace."""
    fields = [line.split("\t") for line in trace.splitlines()]
    sides = [f[1] for f in fields if len(f) > 1 and f[1] in ("F", "B")]
    counts = {"round_trips": sum(1 for p in itertools.pairwise(sides) if p == ("F", "B"))}
    for kind in ("Query", "Parse", "Bind"):
        counts[kind] = sum(1 for f in fields if len(f) > 3 and f[1] == "F" and f[3] == kind)
    return counts


async def _traced(conn: psycopg.AsyncConnection[Any],
                  work: Callable[[], Awaitable[Any]]) -> tuple[Any, dict[str, int], str]:
    with tempfile.TemporaryFile("w+") as trace:
        conn.pgconn.trace(trace.fileno())
        try:
            result = await work()
        finally:
            conn.pgconn.untrace()
        trace.seek(0)
        text = trace.read()
    return result, _trace_counts(text), text


def _claim_options(handlers: list[str]) -> dict[str, Any]:
    return {"worker_id": uuid.uuid4(), "lease_seconds": 30, "handlers": handlers}


def test_prepared_sql__numbers_named_placeholders_once_each() -> None:
    assert prepared_sql("SELECT %(a)s, %(b)s, %(a)s, '100%%'") == (
        "SELECT $1, $2, $1, '100%'", ("a", "b"))
    with pytest.raises(ValueError, match="positional"):
        prepared_sql("SELECT %s")


@pytest.mark.parametrize("via", ["prepared", "functions"])
@pytest.mark.parametrize("conforming", ["on", "off"])
def test_trip__hostile_names_inputs_and_results_arrive_unchanged(
        conn: psycopg.Connection, dsn: str, conforming: str, via: Via) -> None:
    """Tenants, handlers (a claim's parameter), inputs (JSON text back from the claim) and
    results (the finish's parameter) full of quotes, backslashes, dollar quotes, semicolons
    and non-ASCII text go through a claim and a finish on the trip path unchanged, whatever
    standard_conforming_strings says (libpq quotes for the session's setting), whether the
    trip executes prepared statements or calls the hot functions (behind a pooler)."""
    runs = {runpool.enqueue(conn, f"tenant {h}", f"handler {h}", _hostile_json(i)): i
            for i, h in enumerate(HOSTILE)}
    handlers = [f"handler {h}" for h in HOSTILE]

    async def main() -> tuple[list[ClaimedRun], list[str | None], int]:
        pool = await open_pool(dsn, size=1, name="test-trips")
        try:
            async with pool.connection() as c:
                await c.execute(f"SET standard_conforming_strings = {conforming}")
                claimed = await claim(c, limit=100, via=via, **_claim_options(handlers))
                prepared = await (await c.execute(OURS)).fetchone()
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), via=via)
            writing = asyncio.create_task(writer.run())
            try:
                statuses = await asyncio.wait_for(asyncio.gather(*[
                    writer.submit(from_result(r.id, r.attempt, _hostile_json(runs[r.id] + 1),
                                              max_bytes=1 << 20)) for r in claimed]), 30)
            finally:
                writing.cancel()
            assert prepared is not None
            return claimed, statuses, prepared[0]
        finally:
            await pool.close()

    claimed, statuses, prepared = asyncio.run(main())
    # The trip path it was: the session prepared the statements, or the functions did it all.
    assert prepared == (len(HOT) if via == "prepared" else 0)
    assert sorted(r.id for r in claimed) == sorted(runs)
    for run in claimed:
        i = runs[run.id]
        assert (run.tenant, run.handler) == (f"tenant {HOSTILE[i]}", f"handler {HOSTILE[i]}")
        assert isinstance(run.input, bytes)  # undecoded JSON text, decoded in the slot
        assert orjson.loads(run.input) == _hostile_json(i)
    assert statuses == ["succeeded"] * len(claimed)
    for run_id, i in runs.items():
        assert run_row(conn, run_id)["result"] == _hostile_json(i + 1)


# What a worker session pins and a functions trip sets for its transaction only.
SESSION = """
SELECT current_setting('plan_cache_mode'), current_setting('jit'),
       current_setting('enable_seqscan'), (SELECT count(*) FROM pg_prepared_statements)
"""


def test_functions_trip__a_claim_is_one_query_and_leaves_the_session_as_it_was(
        conn: psycopg.Connection, dsn: str) -> None:
    """Behind a pooler a claim calls the hot functions: one Query message, no Parse, one round
    trip, and the server session (the pooler's, next lent to anyone) keeps none of its
    settings and no prepared statement. It runs read committed whatever default another
    client of that session SET (the serial keys' heal, in the reap, refuses anything else)."""
    run_id = runpool.enqueue(conn, "acme", "noop")

    async def main() -> tuple[Any, dict[str, int], Any, Any]:
        async with await aconnect(dsn, autocommit=True) as c:
            await c.execute("SET default_transaction_isolation = 'repeatable read'")
            before = await (await c.execute(SESSION)).fetchone()
            claimed, counts, _ = await _traced(c, lambda: claim(
                c, limit=1, via="functions", touch=True, on_schedules=lambda *a: None,
                on_skipped=lambda skipped: None, **_claim_options(["noop"])))
            return claimed, counts, before, await (await c.execute(SESSION)).fetchone()

    claimed, counts, before, after = asyncio.run(main())
    assert [r.id for r in claimed] == [run_id]
    assert counts == {"round_trips": 1, "Query": 1, "Parse": 0, "Bind": 0}
    assert after == before and before[3] == 0


def test_trip__a_claim_is_one_simple_query_of_executes(
        conn: psycopg.Connection, dsn: str) -> None:
    """After the session's first trip (which prepares), a claim is one Query message: no
    Parse, no Bind, one round trip, every statement an EXECUTE of a prepared one."""
    run_id = runpool.enqueue(conn, "acme", "noop")

    async def main() -> tuple[Any, dict[str, int], str]:
        async with await aconnect(dsn, autocommit=True) as c:
            assert await claim(c, limit=1, via="prepared", **_claim_options(["none"])) == []
            return await _traced(c, lambda: claim(
                c, limit=1, via="prepared", touch=True, on_schedules=lambda *a: None,
                on_skipped=lambda skipped: None, **_claim_options(["noop"])))

    claimed, counts, text = asyncio.run(main())
    assert [r.id for r in claimed] == [run_id]
    assert counts == {"round_trips": 1, "Query": 1, "Parse": 0, "Bind": 0}
    # The reap's four (with the schedules' probe), the touch, promote_due, wake_due, the
    # locks and the claim.
    assert text.count("EXECUTE runpool_") == 9


def test_trip__a_refused_statement_commits_nothing(conn: psycopg.Connection, dsn: str) -> None:
    """A finish and then a claim the server refuses (its lease's interval overflows) in one
    trip: the error skips the rest and rolls the finish back, and the session is ready for the
    next trip."""
    done, queued = (runpool.enqueue(conn, "acme", "noop") for _ in range(2))

    async def main() -> psycopg.pq.TransactionStatus:
        async with await aconnect(dsn, autocommit=True) as c:
            (run,) = await claim(c, limit=1, via="prepared", **_claim_options(["noop"]))
            trip = Trip(c)
            await trip.execute(QUERIES["finish_runs"], finish_params(
                [from_result(run.id, run.attempt, {"ok": 1}, max_bytes=1 << 20)]))
            await claim_statements(trip, limit=1, worker_id=uuid.uuid4(), lease_seconds=1e300,
                                   handlers=["noop"])
            with pytest.raises(psycopg.DataError):
                await trip.send()
            status = c.info.transaction_status
            (again,) = await claim(c, limit=1, via="prepared", **_claim_options(["noop"]))
            assert again.id == queued
            return status

    assert asyncio.run(main()) == IDLE
    assert run_row(conn, done)["status"] == "running"
    assert run_row(conn, queued)["status"] == "running"


REFUSE = """
CREATE FUNCTION refuse_poison() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'refused' USING ERRCODE = '23514';
END $$;
CREATE TRIGGER refuse_poison BEFORE UPDATE ON runpool.runs FOR EACH ROW
WHEN (jsonb_typeof(NEW.result) = 'object' AND NEW.result ? 'poison')
EXECUTE FUNCTION refuse_poison();
"""


class _Refill:
    """Claims up to five noop runs per batch; records what it was handed."""

    def __init__(self) -> None:
        self.handed: list[ClaimedRun] = []

    def capacity(self, freed: int) -> int:
        return 5

    async def statements(self, conn: Statements, limit: int) -> PendingClaim:
        return await claim_statements(conn, limit=limit, **_claim_options(["noop"]))

    def started(self, claimed: list[ClaimedRun], sent: float) -> None:
        self.handed.extend(claimed)


def test_trip__a_refused_batch_is_split_and_its_refill_never_commits(
        conn: psycopg.Connection, dsn: str) -> None:
    """A worker session's batch whose finish the database refuses raises, so the writer splits
    it (the refused outcome alone becomes the run's failure); the refill that rode the refused
    trip committed nothing (the halves go without one)."""
    conn.execute(REFUSE)
    ids = [runpool.enqueue(conn, "acme", "sleep") for _ in range(6)]
    spare = runpool.enqueue(conn, "acme", "noop")
    poisoned = ids[2]

    async def main() -> tuple[list[str | None], list[ClaimedRun]]:
        async with await aconnect(dsn, autocommit=True) as c:
            claimed = await claim(c, limit=6, via="prepared", **_claim_options(["sleep"]))
        pool = await open_pool(dsn, size=1, name="test-trips")
        try:
            refill = _Refill()
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill, via="prepared")
            submitted = [asyncio.create_task(writer.submit(from_result(
                r.id, r.attempt, {"poison": True} if r.id == poisoned else {"ok": 1},
                max_bytes=1 << 20))) for r in claimed]
            await asyncio.sleep(0)  # all queued: they go as one batch
            writing = asyncio.create_task(writer.run())
            try:
                statuses = await asyncio.wait_for(asyncio.gather(*submitted), 30)
            finally:
                writing.cancel()
            by_id = dict(zip([r.id for r in claimed], statuses, strict=True))
            return [by_id[i] for i in ids], refill.handed
        finally:
            await pool.close()

    statuses, handed = asyncio.run(main())
    assert statuses == ["failed" if i == poisoned else "succeeded" for i in ids]
    assert run_row(conn, poisoned)["error"]["reason"] == "outcome_rejected"
    assert (handed, run_row(conn, spare)["status"]) == ([], "queued")


@pytest.mark.parametrize("lose", ["DISCARD ALL", "DEALLOCATE runpool_claim_runs"])
def test_trip__a_session_that_lost_its_statements_prepares_them_again(
        conn: psycopg.Connection, dsn: str, lose: str) -> None:
    ids = [runpool.enqueue(conn, "acme", "noop") for _ in range(2)]

    async def main() -> tuple[list[uuid.UUID], int]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = [r.id for r in await claim(c, limit=1, via="prepared",
                                             **_claim_options(["noop"]))]
            await c.execute(lose)
            got += [r.id for r in await claim(c, limit=1, via="prepared",
                                              **_claim_options(["noop"]))]
            prepared = await (await c.execute(OURS)).fetchone()
            assert prepared is not None
            return got, prepared[0]

    got, prepared = asyncio.run(main())
    assert sorted(got) == sorted(ids)
    assert prepared == len(HOT)


def test_trip__a_stateless_session_keeps_the_pipeline_and_prepares_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    """Behind a transaction-mode pooler the session is not ours: a stateless pool's claim and
    batch go as psycopg's pipeline (Parse/Bind, no Query), and nothing is PREPAREd."""
    run_id = runpool.enqueue(conn, "acme", "noop")

    async def main() -> tuple[dict[str, int], dict[str, int], int]:
        pool = await open_pool(dsn, size=1, name="test-trips", stateless=True)
        try:
            async with pool.connection() as c:  # the pool's one connection, traced below
                (run,), claiming, _ = await _traced(c, lambda: claim(
                    c, limit=1, via="pipeline", **_claim_options(["noop"])))
            writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=_Refill(),
                                   via="pipeline")
            writing = asyncio.create_task(writer.run())
            try:
                _, batch, _ = await _traced(c, lambda: asyncio.wait_for(writer.submit(
                    from_result(run.id, run.attempt, {"ok": 1}, max_bytes=1 << 20)), 30))
            finally:
                writing.cancel()
            async with pool.connection() as c:
                prepared = await (await c.execute(OURS)).fetchone()
                assert prepared is not None
            return claiming, batch, prepared[0]
        finally:
            await pool.close()

    claiming, batch, prepared = asyncio.run(main())
    for counts in (claiming, batch):
        assert counts["Query"] == 0 and counts["Bind"] > 0
    assert prepared == 0
    assert run_row(conn, run_id)["status"] == "succeeded"


@pytest.mark.parametrize("delay_us", range(0, 3000, 373))
def test_trip__a_claim_cancelled_anywhere_strands_nothing_silently(
        conn: psycopg.Connection, dsn: str, delay_us: int) -> None:
    """Cancelled at any point of its trip (the first one also prepares): the connection is
    idle with no result pending, and a run is claimed only if the claim returned it."""
    runpool.enqueue_many(conn, [runpool.RunSpec(f"t{i}", "noop") for i in range(4)])
    conn.commit()

    async def main() -> tuple[object, bool, list[uuid.UUID]]:
        async with await aconnect(dsn, autocommit=True) as c:
            cancelled, got = await claim_cancelled_after(
                c, delay_us, limit=5, via="prepared", **_claim_options(["noop"]))
            status = c.info.transaction_status
            cur = await c.execute("SELECT 42")
            assert await cur.fetchone() == (42,)
            # And the session's trips still work (prepared, or prepared again).
            await claim(c, limit=5, via="prepared", **_claim_options(["none"]))
            return status, cancelled, got

    status, cancelled, got = asyncio.run(main())
    running = [r for (r,) in conn.execute("SELECT id FROM runpool.runs WHERE status = 'running'")]
    assert status == IDLE
    if not cancelled:
        assert sorted(running) == sorted(got)


def test_trip__refuses_what_it_cannot_send_faithfully(dsn: str) -> None:
    """A NUL (libpq's quoting would cut the text there), parameters for a statement that is
    not prepared, and a connection outside autocommit (the trip's all-or-nothing is the
    implicit transaction's)."""

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            trip = Trip(c)
            with pytest.raises(psycopg.DataError, match="NUL"):
                await trip.execute(QUERIES["touch_worker"], {"worker_id": "a\x00b"})
            with pytest.raises(psycopg.ProgrammingError, match="HOT"):
                await trip.execute("SELECT %(x)s", {"x": 1})
        async with await aconnect(dsn, autocommit=False) as c:
            with pytest.raises(psycopg.ProgrammingError, match="autocommit"):
                Trip(c)

    asyncio.run(main())
