"""Group commit of checkpoint writes (runpool/commits.py): writes waiting together share a
commit, a refused or failing write fails alone, a broken connection repeats every write."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

import runpool
from runpool.commits import MAX_INFLIGHT, CommitGroup
from runpool.db import aconnect, connect
from runpool.deadlines import transient
from runpool.errors import LeaseLost
from runpool.lane_locks import refused, transiently
from runpool.pools import open_pool
from tests.helpers import running_pool, scalar, wait_for

TABLE = "CREATE TABLE written (x int PRIMARY KEY, tries int NOT NULL)"


def _insert(x: int) -> Any:
    async def op(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        # Safe to repeat, as checkpoint writes are: a later try accepts its own earlier row.
        cur = await conn.execute(
            "INSERT INTO written VALUES (%s, %s) ON CONFLICT (x) DO NOTHING RETURNING x",
            (x, tries))
        row = await cur.fetchone()
        return x if row is None else int(row[0])
    return op



def _only_30_and_40_failed(dsn: str, out: list[Any]) -> None:
    """Write 30 divided by zero and write 40 was fenced out; the other 78 went in, once each."""
    assert isinstance(out[30], psycopg.errors.DivisionByZero)
    assert isinstance(out[40], LeaseLost)
    assert [x for x in range(80) if out[x] != x] == [30, 40]
    with connect(dsn, autocommit=True) as conn:
        rows = [x for (x,) in conn.execute("SELECT x FROM written ORDER BY x")]
    assert rows == [x for x in range(80) if x not in (30, 40)]

def test_commit_group__waiting_writes_share_commits_and_a_failing_one_fails_alone(
        dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)

    async def refused(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        await conn.execute("SELECT 1")
        raise LeaseLost("this attempt lost its lease")  # no database error: nothing written

    async def failing(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        await conn.execute("SELECT 1 / 0")  # aborts the shared transaction
        return -1

    async def main() -> list[Any]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="test-commits")
        try:
            group = CommitGroup(pool)
            ops = [failing if x == 30 else refused if x == 40 else _insert(x) for x in range(80)]
            out = await asyncio.gather(*(group.write(op, 10, what="test") for op in ops),
                                       return_exceptions=True)
            assert group.commits < group.writes, (group.commits, group.writes)
            return out
        finally:
            await pool.close()

    out = asyncio.run(main())
    _only_30_and_40_failed(dsn, out)


def test_commit_group__a_connection_broken_mid_batch_repeats_each_write_once(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)

    async def breaks_once(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        if tries == 0:
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return int(await _insert(999)(conn, tries))

    async def main() -> list[Any]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="test-commits")
        try:
            group = CommitGroup(pool)
            ops = [breaks_once if x == 50 else _insert(x) for x in range(100)]
            return await asyncio.gather(*(group.write(op, 20, what="test") for op in ops))
        finally:
            await pool.close()

    out = asyncio.run(main())
    assert out == [999 if x == 50 else x for x in range(100)]
    with connect(dsn, autocommit=True) as conn:
        assert scalar(conn, "SELECT count(*) FROM written") == 100


def test_commit_group__a_real_pool_of_agents_commits_less_than_once_per_write(
        dsn: str, server_dsn: str) -> None:
    # 60 runs of 8 turns each (a tool call: intent + result; a message) on one worker with
    # no model wait: without grouping that is 3 commits a turn.
    runs, turns = 60, 8
    name = str(conninfo_to_dict(dsn)["dbname"])
    with connect(dsn, autocommit=True) as conn, connect(server_dsn, autocommit=True) as stats:
        with running_pool(dsn, "runpool.harness.benchapp:app", workers=1, concurrency=runs,
                          pool_size=8):
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.workers") == 1, 60)
            stats.execute("SELECT pg_stat_clear_snapshot()")
            before = scalar(stats, "SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                            name)
            runpool.enqueue_many(conn, [runpool.RunSpec(
                "acme", "agent", {"turns": turns, "low": 0.0, "high": 0.001})] * runs)
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                          " WHERE status = 'succeeded'") == runs, 120)
            stats.execute("SELECT pg_stat_clear_snapshot()")
            after = scalar(stats, "SELECT xact_commit FROM pg_stat_database WHERE datname = %s",
                           name)
        # Every run's conversation is whole and in order: a tool message and a message a turn.
        per_run = conn.execute(
            "SELECT run_id, count(*), max(seq), count(*) FILTER (WHERE role = 'tool')"
            " FROM runpool.messages GROUP BY run_id").fetchall()
        calls = scalar(conn, "SELECT count(*) FROM runpool.tool_calls"
                             " WHERE status = 'succeeded' AND executions = 1")
    assert len(per_run) == runs
    assert all((n, top, tools) == (2 * turns, 2 * turns, turns) for _, n, top, tools in per_run)
    assert calls == runs * turns
    writes = runs * turns * 3
    # The stats collector may lag the last commits: the bound is loose on purpose.
    assert after - before < writes * 0.8, (after - before, writes)


def test_commit_group__a_write_alone_commits_alone(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)

    async def main() -> tuple[int, int, Any]:
        pool = await open_pool(dsn, size=2, name="test-commits")
        try:
            group = CommitGroup(pool)
            got = [await group.write(_insert(x), 10, what="test") for x in range(5)]
            return group.commits, group.writes, got
        finally:
            await pool.close()

    assert asyncio.run(main()) == (5, 5, [0, 1, 2, 3, 4])


@dataclass(frozen=True)
class _Statement:
    query: str
    params: dict[str, Any]
    answer: Callable[[psycopg.AsyncConnection[Any], Any], Awaitable[Any]]
    batch: None = None
    row: bytes = b""

    def batch_params(self, rows: list[bytes], *, ring: bool = True) -> dict[str, Any]:
        raise AssertionError("a write without a batch form is never batched")


def _statement(x: int) -> tuple[Any, _Statement]:
    """A write of x as an op and as a statement: x 30 fails in the database (after the
    statements before it in its pipeline ran), x 40 writes nothing and is refused, as a
    fenced write of a lost lease is."""
    query = ("INSERT INTO written SELECT %(x)s / (%(x)s - 30) * 0 + %(x)s, 0"
             " WHERE %(x)s <> 40 ON CONFLICT (x) DO NOTHING RETURNING x")

    async def answer(conn: psycopg.AsyncConnection[Any], row: Any) -> int:
        if x == 40:
            raise LeaseLost("this attempt lost its lease")
        return x if row is None else int(row[0])

    statement = _Statement(query, {"x": x}, answer)

    async def op(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        cur = await conn.execute(query, {"x": x})
        return int(await answer(conn, await cur.fetchone()))

    return op, statement


def test_commit_group__statements_go_in_one_pipeline_and_a_failing_one_still_fails_alone(
        dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute(TABLE)

    async def main(xs: range) -> tuple[list[Any], int, int]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="test-commits")
        try:
            group = CommitGroup(pool)
            writes = [_statement(x) for x in xs]
            # Bounded: a write the group lost would never be answered.
            out = await asyncio.wait_for(asyncio.gather(
                *(group.write(op, 10, what="test", statement=s) for op, s in writes),
                return_exceptions=True), 60)
            return out, group.pipelined, group.commits
        finally:
            await pool.close()

    out, pipelined, commits = asyncio.run(main(range(80)))
    _only_30_and_40_failed(dsn, out)
    # Without a failing statement: the first MAX_INFLIGHT writes go alone at once, the others
    # wait and go in batches, each batch one pipeline.
    out, pipelined, commits = asyncio.run(main(range(100, 180)))
    assert out == list(range(100, 180))
    assert pipelined == 80 - MAX_INFLIGHT
    assert commits < 80


def test_a_batch_goes_again_as_first_tries_only_when_the_database_refused_a_statement(
        dsn: str) -> None:
    """A batch sent with its COMMIT that fails goes again as first tries (no read-back) only if
    nothing of it can have been committed: the server refused one of its statements. A cut
    connection, or an error without SQLSTATE on a connection not yet marked broken (a cut
    once surfaced as "cannot exit pipeline mode while busy", after the COMMIT: the batch's
    messages were stored twice), is answered to each write, which is repeated reading back
    first."""
    async def main() -> list[bool]:
        seen: list[bool] = []
        async with await aconnect(dsn, autocommit=True) as conn, \
                await aconnect(dsn, autocommit=True) as other:
            try:
                await conn.execute("SELECT %s::text::jsonb", ['"\\u0000"'])
            except psycopg.Error as exc:
                seen.append(refused(conn, exc))  # refused: its data
            try:
                await conn.execute("SELECT 1 / (SELECT count(*) FROM pg_class WHERE false)")
            except psycopg.Error as exc:
                seen.append(refused(conn, exc))  # refused: the statement
            seen.append(refused(conn, psycopg.OperationalError(
                "cannot exit pipeline mode while busy")))
            pid = (await (await conn.execute("SELECT pg_backend_pid()")).fetchall())[0][0]
            await other.execute("SELECT pg_terminate_backend(%s)", [pid])
            try:
                await conn.execute("SELECT 1")
            except psycopg.Error as exc:
                seen.append(refused(conn, exc))  # cut
        return seen

    assert asyncio.run(main()) == [True, True, False, False]
    # Not refused, the error goes to every write of the batch as one each repeats: one
    # write's bad data, seen as the connection was cut, once failed its batch's other writes
    # for good.
    bad_data = psycopg.errors.UntranslatableCharacter("unsupported Unicode escape sequence")
    assert transient(transiently(bad_data)) and transiently(bad_data).__cause__ is bad_data
