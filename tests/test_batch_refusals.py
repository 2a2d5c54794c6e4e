"""A write without a statement form refused by the database with an error its op translates
(waits.commit_wait, waits.spawn: InvalidInput, UsageError; not a psycopg.Error) leaves the
batch's shared transaction aborted. The group commit took it for a write refused without an
error and carried on: the others' writes failed for good, or (before session 8) were answered
as committed though the COMMIT rolled them back (an attack, helper-56). Now that write gets its
error and the others go again."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from runpool import commits
from runpool.commits import CommitGroup
from runpool.db import connect
from runpool.enqueue import RunSpec, enqueue_many
from runpool.errors import InvalidInput, UsageError
from runpool.pools import open_pool
from runpool.waits import commit_wait, spawn, spawn_params

from .test_attack3_batch import _message

HOLD = """
UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
       lease_expires_at = now() + interval '1 hour'
WHERE id = ANY(%s)
"""


def _held(dsn: str, specs: list[RunSpec]) -> list[uuid.UUID]:
    with connect(dsn, autocommit=True) as conn:
        ids = enqueue_many(conn, specs)
        conn.execute(HOLD, (ids,))
        return ids


@pytest.mark.parametrize("how", ["wait", "spawn"])
@pytest.mark.parametrize("evil_at", ["first", "last"])
def test_a_refused_wait_or_spawn_does_not_fail_or_lose_other_tenants_writes(dsn: str, evil_at: str,
                                                                   how: str) -> None:
    lanes = commits.MAX_INFLIGHT
    acme = _held(dsn, [RunSpec("acme", "agent", {})] * (lanes + 8))
    # A run with a serial key cannot wait: runpool._wait raises feature_not_supported, which
    # commit_wait turns into InvalidInput (not a psycopg.Error).
    (evil,) = _held(dsn, [RunSpec("evil", "agent", {}, serial_key="k" if how == "wait" else None)])
    if how == "spawn":  # a spawn while a cancel of the run is requested: UsageError
        with connect(dsn, autocommit=True) as c:
            c.execute("UPDATE runpool.runs SET cancel_requested_at = now() WHERE id = %s", (evil,))

    order: list[uuid.UUID] = []

    async def main() -> list[Any]:
        pool = await open_pool(dsn, size=lanes + 3, name="attack10")
        try:
            group = CommitGroup(pool)

            def write(run_id: uuid.UUID, text: str, *, piped: bool) -> Any:
                op, st = _message(run_id, {"text": text})
                return group.write(op, 10, what="test", statement=st if piped else None)

            async def evil_wait(conn: psycopg.AsyncConnection[Any], tries: int) -> Any:
                if how == "spawn":
                    return await spawn(conn, parent=evil, attempt=1, call_id="c1",
                                       params=spawn_params("evil", "agent", {}, {}),
                                       traceparent=None)
                return await commit_wait(conn, run_id=evil, attempt=1, seq=1, kind="sleep",
                                         timeout=60.0)

            coros: list[Any] = []
            # Fill the lanes, so what follows goes as one batch.
            coros += [write(r, "lane", piped=True) for r in acme[:lanes]]
            batch = acme[lanes:]
            piped = [write(r, "piped", piped=True) for r in batch[:4]]
            plain = [write(r, "plain", piped=False) for r in batch[4:]]
            bad = group.write(evil_wait, 10, what="wait")
            coros += piped + ([bad, *plain] if evil_at == "first" else [*plain, bad])
            order.extend([*acme[:lanes], *batch[:4]]
                         + ([evil, *batch[4:]] if evil_at == "first" else [*batch[4:], evil]))
            return list(await asyncio.wait_for(asyncio.gather(*coros, return_exceptions=True),
                                               60))
        finally:
            await pool.close()

    out = asyncio.run(main())
    with connect(dsn, autocommit=True) as conn:
        stored = dict(conn.execute(
            "SELECT run_id, count(*) FROM runpool.messages GROUP BY run_id").fetchall())
    answers = dict(zip(order, out, strict=True))
    failed = [repr(answers[r]) for r in acme if isinstance(answers[r], BaseException)]
    lost = [r for r in acme if not isinstance(answers[r], BaseException)
            and stored.get(r, 0) != 1]
    # The refused write gets its own error; nobody else's write fails or is lost.
    assert isinstance(answers[evil], InvalidInput | UsageError), repr(answers[evil])
    assert not failed, f"{len(failed)} of acme's writes failed: {failed}"
    assert all(stored.get(r, 0) == 1 for r in acme), (lost, stored)
