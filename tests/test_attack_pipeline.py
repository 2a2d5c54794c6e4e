"""Attack on the pipelined group commit (commits.py) with real fenced checkpoint writes: a
zombie attempt's writes in a batch, a statement the database fails, a connection cut while
batches are in flight, and PgBouncer in transaction mode. Each run's writes land once, and
its events keep unique seqs in commit order."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import orjson
import psycopg
from psycopg.types.json import Jsonb

import checkpoints
from runpool.commits import MAX_INFLIGHT, CommitGroup
from runpool.db import connect
from runpool.enqueue import RunSpec, enqueue_many
from runpool.errors import LeaseLost
from runpool.pools import open_pool
from runpool.testing import Proxy

from .helpers import agent_turns
from .pgbouncer import pgbouncer

# The runs as a worker holds them (attempt 1), as runpool.harness.turn_cost does.
HOLD = """
UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
       lease_expires_at = now() + interval '1 hour'
WHERE id = ANY(%s)
"""
# Every numbered event of a run (its status events, messages, tool call starts and ends),
# with the run's counter.
SEQS = """
SELECT array(SELECT seq FROM runpool.status_history WHERE run_id = r.id
             UNION ALL SELECT event_seq FROM runpool.messages WHERE run_id = r.id
             UNION ALL SELECT started_seq FROM runpool.tool_calls WHERE run_id = r.id
             UNION ALL SELECT finished_seq FROM runpool.tool_calls
                       WHERE run_id = r.id AND finished_seq IS NOT NULL ORDER BY 1),
       (SELECT seq FROM runpool.event_seqs WHERE run_id = r.id),
       (SELECT count(*) FROM runpool.messages WHERE run_id = r.id),
       (SELECT count(*) FROM runpool.tool_calls
        WHERE run_id = r.id AND status = 'succeeded' AND executions = 1)
FROM runpool.runs r WHERE r.id = %s
"""
# A statement the database fails (the test's own trigger): a message whose content is "boom".
BOOM = """
CREATE FUNCTION public.boom() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.content = '"boom"'::jsonb THEN RAISE EXCEPTION 'boom'; END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER boom BEFORE INSERT ON runpool.messages FOR EACH ROW EXECUTE FUNCTION public.boom()
"""
TURNS = 4


async def _lookup(arguments: Any, key: str) -> Any:
    return {"turn": arguments["turn"]}


def _held(dsn: str, n: int) -> list[uuid.UUID]:
    with connect(dsn, autocommit=True) as conn:
        ids = enqueue_many(conn, [RunSpec("acme", "agent", {})] * n)
        conn.execute(HOLD, (ids,))
        return ids


def _agents(dsn: str, ids: list[uuid.UUID], *, boom: uuid.UUID | None = None,
            stateless: bool = False, meanwhile: Any = None) -> tuple[list[Any], int]:
    """TURNS turns (a tool call, a message) of each run at once through one CommitGroup; each
    run's outcome (None or its exception) and how many writes went in a pipeline."""
    out, pipelined, _ = _agents_counted(dsn, ids, boom=boom, stateless=stateless,
                                        meanwhile=meanwhile)
    return out, pipelined


def _agents_counted(dsn: str, ids: list[uuid.UUID], *, boom: uuid.UUID | None = None,
                    stateless: bool = False, meanwhile: Any = None
                    ) -> tuple[list[Any], int, int]:
    """_agents(), and the statements the pipelined writes were sent as."""

    async def main() -> tuple[list[Any], int, int]:
        pool = await open_pool(dsn, size=6, name="attack-pipeline", stateless=stateless)
        try:
            # Behind the pooler, the batches call the batch statements' functions (the
            # session is not ours to keep prepared statements in: runpool.pooled).
            group = CommitGroup(pool, via="functions" if stateless else "prepared")

            async def agent(run_id: uuid.UUID) -> None:
                await agent_turns(pool, group, run_id, TURNS, "search", _lookup, lambda turn:
                                  "boom" if run_id == boom and turn == 2 else {"turn": turn})

            tasks = [asyncio.ensure_future(agent(i)) for i in ids]
            if meanwhile is not None:
                await meanwhile(group)
            out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
            return list(out), group.pipelined, group.statements
        finally:
            await pool.close()

    return asyncio.run(main())


def _check(dsn: str, ids: list[uuid.UUID], *, short: dict[uuid.UUID, int]) -> None:
    """Each run: its writes exactly once (`short`: runs that stopped after that many turns),
    its seqs unique and within its counter."""
    with connect(dsn, autocommit=True) as conn:
        for run_id in ids:
            row = conn.execute(SEQS, (run_id,)).fetchone()
            assert row is not None
            seqs, counter, messages, calls = row
            turns = short.get(run_id, TURNS)
            assert len(seqs) == len(set(seqs)), (run_id, seqs)
            assert (messages, calls) == (2 * turns, turns), run_id
            if turns:
                assert seqs[-1] <= counter, (run_id, seqs, counter)


def test_a_zombie_and_a_failing_statement_in_pipelined_batches(dsn: str) -> None:
    ids = _held(dsn, 40)
    zombie, boom = ids[7], ids[23]
    with connect(dsn, autocommit=True) as conn:
        conn.execute(BOOM)
        # Reclaimed and running again in attempt 2 before its attempt 1 wrote anything.
        conn.execute("UPDATE runpool.runs SET attempt = 2 WHERE id = %s", (zombie,))
        before = conn.execute("SELECT event_seq FROM runpool.runs WHERE id = %s",
                              (zombie,)).fetchone()
    out, pipelined, statements = _agents_counted(dsn, ids, boom=boom)
    assert pipelined > 0
    # Batched: a batch's writes of one kind (a message, a tool call's start, its end) went as
    # one statement, the zombie's and the failing run's among them.
    assert statements < pipelined / 2, (statements, pipelined)
    assert isinstance(out[ids.index(zombie)], LeaseLost)
    assert isinstance(out[ids.index(boom)], psycopg.errors.RaiseException)
    assert [i for i, o in zip(ids, out, strict=True) if o is not None] == [zombie, boom]
    with connect(dsn, autocommit=True) as conn:
        # The zombie wrote and numbered nothing.
        assert conn.execute("SELECT event_seq, (SELECT count(*) FROM runpool.event_seqs"
                            " WHERE run_id = %s) FROM runpool.runs WHERE id = %s",
                            (zombie, zombie)).fetchone() == (before[0] if before else None, 0)
        # The failing run: its third turn's tool call committed, its message never.
        assert conn.execute("SELECT count(*) FROM runpool.messages WHERE run_id = %s",
                            (boom,)).fetchone() == (5,)
    _check(dsn, [i for i in ids if i not in (zombie, boom)], short={})


def test_connections_cut_while_pipelined_batches_are_in_flight(dsn: str) -> None:
    ids = _held(dsn, 40)
    proxy = Proxy(dsn)
    try:
        async def cut_twice(group: CommitGroup) -> None:
            # Early, while the batches are in flight: since writes of one kind go as one
            # statement, 40 agents may be done within 0.15 s, and a cut after that forces no
            # reconnect (CI: `reconnected` false). The first cut once a batch has committed
            # (a cut before any, and the repeats after it go alone, may leave none pipelined).
            async def batched() -> None:
                while group.pipelined == 0:  # noqa: ASYNC110 - the group's counter, bounded below
                    await asyncio.sleep(0.001)

            await asyncio.wait_for(batched(), 30)
            await asyncio.to_thread(proxy.cut)
            await asyncio.sleep(0.04)
            await asyncio.to_thread(proxy.cut)

        out, pipelined = _agents(proxy.dsn(dsn), ids, meanwhile=cut_twice)
        reconnected = proxy.connections > 6  # the pool's 6, then new ones after each cut
    finally:
        proxy.close()
    assert reconnected
    assert out == [None] * len(ids), [repr(o) for o in out if o is not None]
    assert pipelined > 0
    _check(dsn, ids, short={})


def test_pipelined_batches_through_pgbouncer_in_transaction_mode(
        dsn: str, server_dsn: str) -> None:
    ids = _held(dsn, 40)
    with pgbouncer(server_dsn, pool_size=3) as bouncer:
        out, pipelined = _agents(bouncer.dsn(dsn), ids, stateless=True)
    assert out == [None] * len(ids), [repr(o) for o in out if o is not None]
    assert pipelined > 0
    _check(dsn, ids, short={})



def test_a_batch_statement_answers_each_write_as_its_own_statement_would(dsn: str) -> None:
    """Tool call intents of 16 runs through one CommitGroup at once (past MAX_INFLIGHT they
    batch: one statement for the lot): a zombie's is refused (LeaseLost) and a call id reused
    with other arguments (CallMismatch), each alone; the others are written once. Sent again,
    each one this attempt committed is read back (its executions), not written twice."""
    ids = _held(dsn, 16)
    zombie, reused = ids[9], ids[12]
    with connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE runpool.runs SET attempt = 2 WHERE id = %s", (zombie,))
    asyncio.run(_intents(dsn, [reused], {"other": 1}))

    out, statements = asyncio.run(_intents(dsn, ids, {"turn": 0}))
    assert isinstance(out[ids.index(zombie)], LeaseLost)
    assert isinstance(out[ids.index(reused)], checkpoints.CallMismatch)
    assert [o for i, o in zip(ids, out, strict=True) if i not in (zombie, reused)] == [1] * 14
    assert statements < 16 - MAX_INFLIGHT  # the writes past the first MAX_INFLIGHT batched
    again, _ = asyncio.run(_intents(dsn, ids, {"turn": 0}))
    assert [o for i, o in zip(ids, again, strict=True) if i not in (zombie, reused)] == [1] * 14
    with connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*), sum(executions) FROM runpool.tool_calls"
                            ).fetchone() == (15, 15)
        assert conn.execute("SELECT count(*) FROM runpool.event_seqs WHERE run_id = %s",
                            (zombie,)).fetchone() == (0,)


async def _intents(dsn: str, ids: list[uuid.UUID], arguments: Any) -> tuple[list[Any], int]:
    """Each run's intent of call t0 (attempt 1), all at once through one CommitGroup: their
    answers (executions, or the exception) and the statements they went as."""
    pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="attack-pipeline")
    try:
        group = CommitGroup(pool)
        data = orjson.dumps(arguments)
        writes = [checkpoints.intent_write(i, 1, "t0", "search", Jsonb(arguments), encoded=data)
                  for i in ids]

        def op(write: checkpoints.Statement) -> Any:
            async def run(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
                return await write.run(conn)
            return run

        out = await asyncio.wait_for(asyncio.gather(*(
            group.write(op(w), 10, what="test", statement=w) for w in writes),
            return_exceptions=True), 60)
        return list(out), group.statements
    finally:
        await pool.close()
