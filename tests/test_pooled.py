"""The hot statements' functions (runpool.pooled), which a worker behind a transaction-mode
pooler calls: what `migrate` makes and who may call it, and a worker whose database lacks
them (it says so, and drains on the statements themselves)."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

import runpool
from runpool import pooled
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.trips import HOT_STATEMENTS, FunctionsUnusable, Trip
from tests.helpers import assert_invariants, running_pool, scalar, wait_for

# runpool's hot functions and who may call them.
FUNCTIONS = """
SELECT p.proname::text, p.prosecdef, has_function_privilege('runpool_worker', p.oid, 'EXECUTE'),
       has_function_privilege('runpool_api', p.oid, 'EXECUTE'),
       has_function_privilege('public', p.oid, 'EXECUTE')
FROM pg_proc p WHERE p.pronamespace = 'runpool'::regnamespace AND p.proname LIKE 'hot\\_%'
"""
# Each hot function's DROP statement.
DROPS = """
SELECT format('DROP FUNCTION runpool.%I(%s)', p.proname, pg_get_function_identity_arguments(p.oid))
FROM pg_proc p WHERE p.pronamespace = 'runpool'::regnamespace AND p.proname LIKE 'hot\\_%'
"""
DONE = "SELECT count(*) FROM runpool.runs WHERE status = 'succeeded'"


def test_migrate__makes_one_function_per_hot_statement_for_the_worker_role_only(
        conn: psycopg.Connection) -> None:
    rows = conn.execute(FUNCTIONS).fetchall()
    assert sorted(r[0] for r in rows) == sorted(h.function.decode() for h in HOT_STATEMENTS)
    # Invoker's rights (a caller needs the statement's own privileges), workers only.
    assert {r[1:] for r in rows} == {(False, True, False, False)}
    assert pooled.install(conn) == 0  # made once: a migrate with nothing new makes nothing
    assert pooled.missing(conn) == []


@pytest.mark.parametrize("functions", [True, False])
def test_stateless_worker__drains_serial_keys_with_its_functions_or_without_them(
        conn: psycopg.Connection, dsn: str, functions: bool) -> None:
    """A worker whose connections may go through a pooler (a LISTEN DSN of its own: here the
    same server, direct) calls the hot functions; without them it says so and drains all the
    same on the statements themselves, and calls them once a migrate made them (it looks at
    the poll's cadence). Serial keys' runs take the outcome batch's every statement (the
    deferred release, the keys' locks and release)."""
    if not functions:
        for (drop,) in conn.execute(DROPS).fetchall():
            conn.execute(drop)
    specs = [runpool.RunSpec(f"t{i % 3}", "noop", {"i": i}, serial_key=f"k{i % 4}")
             for i in range(60)] + [runpool.RunSpec("t9", "noop", {"i": i}) for i in range(60)]
    runpool.enqueue_many(conn, specs)
    with running_pool(dsn, workers=1, concurrency=8, listen_dsn=dsn, poll_seconds=1) as pool:
        wait_for(lambda: scalar(conn, DONE) == len(specs), timeout=60, what="every run done")
        if not functions:
            assert "hot_functions_found" not in pool.log()
            assert pooled.install(conn) == len(HOT_STATEMENTS)  # what `migrate` does
            wait_for(lambda: "hot_functions_found" in pool.log(), timeout=30,
                     what="the worker finding the functions")
            runpool.enqueue_many(conn, specs)
            wait_for(lambda: scalar(conn, DONE) == 2 * len(specs), timeout=60,
                     what="the runs after the migrate")
        log = pool.log()
    assert ("hot_functions_missing" in log) is not functions
    assert "worker_crashed" not in log and "hot_functions_unusable" not in log
    assert_invariants(conn)


@pytest.mark.parametrize("dropped", ["finish_runs", "claim_runs"])
def test_stateless_worker__falls_back_for_good_when_a_function_goes_missing_mid_run(
        conn: psycopg.Connection, dsn: str, dropped: str) -> None:
    """A hot function dropped while the worker calls it (by hand, or a migration that changed
    its columns' types): the failed trip rolled back whole and goes again the pipeline's way.
    No worker crash, no outcome refused, no run executed twice."""
    first = runpool.enqueue_many(conn, [runpool.RunSpec("t", "noop", {"i": i})
                                        for i in range(20)])
    with running_pool(dsn, workers=1, concurrency=4, listen_dsn=dsn) as pool:
        wait_for(lambda: scalar(conn, DONE) == len(first), timeout=60, what="the first runs")
        (name,) = [h.function.decode() for h in HOT_STATEMENTS
                   if h.name == f"runpool_{dropped}".encode()]
        for (drop,) in conn.execute(DROPS).fetchall():
            if name in drop:
                conn.execute(drop)
        runpool.enqueue_many(conn, [runpool.RunSpec("t", "noop", {"i": i}, serial_key="k")
                                    for i in range(20)])
        wait_for(lambda: scalar(conn, DONE) == 40, timeout=60, what="the runs after the drop")
        log = pool.log()
    assert "hot_functions_unusable" in log
    assert "worker_crashed" not in log and "outcome_rejected" not in log
    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE attempt > 1") == 0
    assert_invariants(conn)


def test_functions_trip__a_function_stale_after_a_migration_says_so_and_other_errors_do_not(
        conn: psycopg.Connection, dsn: str) -> None:
    """A migration that changed a column a hot function returns (its result declared before)
    makes that function unusable: FunctionsUnusable, which the worker's Route falls back on.
    The same SQLSTATE from anything else in a trip is the statement's own refusal."""
    runpool.enqueue(conn, "acme", "noop")
    conn.execute("ALTER TABLE runpool.runs ALTER COLUMN max_attempts TYPE bigint")

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            with pytest.raises(FunctionsUnusable, match="42804"):
                await claim(c, limit=1, via="functions", worker_id=uuid.uuid4(),
                            lease_seconds=30, handlers=["noop"])
            trip = Trip(c, functions=True)
            await trip.execute("SELECT runpool.no_such_function()")
            with pytest.raises(psycopg.errors.UndefinedFunction):
                await trip.send()
            # The pipeline's way the statements are planned on today's schema.
            (run,) = await claim(c, limit=1, via="pipeline", worker_id=uuid.uuid4(),
                                 lease_seconds=30, handlers=["noop"])
            assert run.max_attempts == 3

    asyncio.run(main())
