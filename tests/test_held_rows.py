"""A tenant that holds its own runs' rows open (runpool.signal_run in a transaction it leaves
open) stalls only its own runs' checkpoint writes: a worker's group commit (commits.py) never
waits for a held row in a lane, so the other tenants' writes go on while the held runs' writes
poll for their rows, and land once the tenant's transaction ends."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from runpool.commits import MAX_INFLIGHT, MAX_WAITING, CommitGroup
from runpool.db import connect, open_pool
from runpool.errors import DatabaseTimeout
from runpool.waits import signal_run

from .test_attack3_batch import _held, _message

# More held rows than lanes of any kind (the code before had four lanes, each of which a
# write waiting for a held row kept until that write's deadline).
HELD = 2 * (MAX_INFLIGHT + MAX_WAITING) + 2


def test_a_tenant_holding_its_runs_rows_stalls_only_its_own_writes(dsn: str) -> None:
    acme = _held(dsn, 24, "acme")
    evil = _held(dsn, HELD + 1, "evil")
    late = evil.pop()  # its write's deadline passes while its row is held

    with connect(dsn) as hostile:  # a transaction left open (not autocommit)
        for run_id in [*evil, late]:
            assert signal_run(hostile, run_id, "poke", tenant="evil") == "stored"

        async def main() -> tuple[list[Any], list[Any], BaseException | None]:
            pool = await open_pool(dsn, size=MAX_INFLIGHT + MAX_WAITING + 2, name="held-rows")
            try:
                group = CommitGroup(pool)

                def write(run_id: uuid.UUID, text: str, seconds: float, *, first: bool
                          ) -> asyncio.Task[Any]:
                    op, statement = _message(run_id, {"text": text})
                    return asyncio.ensure_future(group.write(
                        op, seconds, what="test", statement=statement if first else None))

                # The held runs' writes first, as first tries and as writes without one (a
                # usage or wait write, a repeat): in lanes that waited for a row, they would
                # take every lane before anyone else's.
                held = [write(r, "held", 60, first=i % 2 == 0) for i, r in enumerate(evil)]
                timed_out = write(late, "late", 2, first=True)
                others = [write(r, "acme", 60, first=i % 2 == 0) for i, r in enumerate(acme)]
                _, pending = await asyncio.wait(others, timeout=20)
                assert not pending, f"{len(pending)} of acme's writes waited for evil's rows"
                got = [t.result() for t in others]
                await asyncio.wait([timed_out], timeout=20)
                late_error = timed_out.exception() if timed_out.done() else None
                assert not any(t.done() for t in held), "a held run's write did not wait"
                hostile.rollback()
                return got, list(await asyncio.wait_for(asyncio.gather(*held), 30)), late_error
            finally:
                await pool.close()

        got, landed, late_error = asyncio.run(main())

    assert got == [1] * len(acme)
    assert landed == [1] * len(evil)
    # The write whose deadline passed got a timeout naming the cause, and wrote nothing.
    assert isinstance(late_error, DatabaseTimeout), repr(late_error)
    assert "held by another transaction" in str(late_error)
    with connect(dsn, autocommit=True) as conn:
        counts = dict(conn.execute(
            "SELECT run_id, count(*) FROM runpool.messages WHERE run_id = ANY(%s)"
            " GROUP BY run_id", ([*acme, *evil, late],)).fetchall())
    assert counts == {r: 1 for r in [*acme, *evil]}, counts
