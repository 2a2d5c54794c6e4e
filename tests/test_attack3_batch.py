"""Attack on the batched checkpoint writes (checkpoints.store BATCH_*,
commit_sends.BatchSends._one_trip): a batch's writes of one kind go as one statement carrying
the writes as a JSON array."""

from __future__ import annotations

import asyncio
import random
import threading
import uuid
from typing import Any

import orjson
import psycopg

import checkpoints
from runpool.codec import jsonb
from runpool.commits import MAX_BATCH, MAX_INFLIGHT, CommitGroup
from runpool.db import connect
from runpool.enqueue import RunSpec, enqueue_many
from runpool.pools import open_pool
from runpool.waits import signal_run

from .helpers import agent_turns

# The runs as a worker holds them (attempt 1), as runpool.harness.turn_cost does.
HOLD = """
UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
       lease_expires_at = now() + interval '1 hour'
WHERE id = ANY(%s)
"""
N = 16


def _held(dsn: str, n: int, tenant: str = "acme") -> list[uuid.UUID]:
    with connect(dsn, autocommit=True) as conn:
        ids = enqueue_many(conn, [RunSpec(tenant, "agent", {})] * n)
        conn.execute(HOLD, (ids,))
        return ids


def _op(write: checkpoints.Statement) -> Any:
    async def run(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        return await write.run(conn)
    return run


async def _send(dsn: str, writes: list[checkpoints.Statement]) -> tuple[list[Any], CommitGroup]:
    """The writes all at once through one CommitGroup (past MAX_INFLIGHT they batch)."""
    pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="attack3-batch")
    try:
        group = CommitGroup(pool)
        out = await asyncio.wait_for(asyncio.gather(*(
            group.write(_op(w), 10, what="test", statement=w) for w in writes),
            return_exceptions=True), 60)
        return list(out), group
    finally:
        await pool.close()


def _results(ids: list[uuid.UUID], values: list[Any]) -> list[checkpoints.Statement]:
    writes = []
    for run_id, value in zip(ids, values, strict=True):
        data = orjson.dumps(value)
        writes.append(checkpoints.result_write(
            run_id, 1, "t0", status="succeeded", result=jsonb(data), message_role="tool",
            message_content=jsonb(data), encoded=(data, data)))
    return writes


def _intents(ids: list[uuid.UUID]) -> list[checkpoints.Statement]:
    data = orjson.dumps({"q": 1})
    return [checkpoints.intent_write(i, 1, "t0", "search", jsonb(data), encoded=data)
            for i in ids]


def test_a_tool_returning_none_does_not_roll_back_the_batch_it_is_in(dsn: str) -> None:
    """A tool that returns None (JSON null: the commonest result of a tool that only acts) is
    an ordinary write. In a batch statement its null, read by jsonb_to_recordset, becomes SQL
    NULL, not jsonb 'null': the tool message's content (NOT NULL) fails the whole batch
    statement, which is rolled back and every write of the batch (other tenants' included)
    sent again one by one. Expected: the batch's writes all go in batch statements."""
    ids = _held(dsn, N - 1, "acme") + _held(dsn, 1, "other")
    out, _ = asyncio.run(_send(dsn, _intents(ids)))
    assert out == [1] * N
    values: list[Any] = [{"ok": i} for i in range(N - 1)] + [None]
    out, group = asyncio.run(_send(dsn, _results(ids, values)))
    assert all(isinstance(o, int) for o in out), out
    with connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM runpool.messages").fetchone() == (N,)
        assert conn.execute("SELECT result = %s::jsonb FROM runpool.tool_calls"
                            " WHERE run_id = %s", (orjson.dumps(values[-1]).decode(), ids[-1])
                            ).fetchone() == (True,)
    # The writes past the first MAX_INFLIGHT went in batches: every one of them carried by a
    # batch statement (none rolled back and sent again one by one).
    assert group.pipelined == N - MAX_INFLIGHT, (group.writes, group.pipelined,
                                                 group.statements, group.commits)


def _messages(ids: list[uuid.UUID], turn: int = 1) -> list[checkpoints.Statement]:
    data = orjson.dumps({"turn": turn})
    return [checkpoints.message_write(i, 1, "assistant", jsonb(data), encoded=data)
            for i in ids]


def _message(run_id: uuid.UUID, text: Any) -> tuple[Any, checkpoints.Statement]:
    """A message write as a worker makes it (runpool.context): its first try as a batchable
    statement, and an op whose repeat reads back an earlier try that committed."""
    data = orjson.dumps(text)
    first = checkpoints.message_write(run_id, 1, "assistant", jsonb(data), encoded=data)

    async def op(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        if tries:
            seq = await checkpoints.find_message(conn, run_id, 1, 0, "assistant", jsonb(data))
            if seq is not None:
                return seq
        return await first.run(conn)

    return op, first


def test_a_tenant_holding_its_own_run_row_does_not_fail_other_tenants_writes(dsn: str) -> None:
    """Tenant "evil" signals its own running run inside a transaction it keeps open
    (runpool.signal_run on the caller's connection: the run row FOR NO KEY UPDATE until it
    commits). Its run's next checkpoint write waits for that lock, as it would alone. In a
    batch statement, every other tenant's write in the same batch waits with it and fails
    with it at the write deadline (DatabaseTimeout), though their rows were free.
    Expected: only evil's own write waits or fails; acme's writes land."""
    ids = _held(dsn, N - 1, "acme") + _held(dsn, 1, "evil")
    evil = ids[-1]
    with connect(dsn) as hostile:  # a transaction left open (not autocommit)
        assert signal_run(hostile, evil, "poke", tenant="evil") == "stored"

        async def writes() -> list[Any]:
            pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="attack3-batch")
            try:
                group = CommitGroup(pool)
                return list(await asyncio.wait_for(asyncio.gather(*(
                    group.write(_op(w), 3, what="test", statement=w)
                    for w in _messages(ids)), return_exceptions=True), 60))
            finally:
                await pool.close()

        out = asyncio.run(writes())
        hostile.rollback()
    acme = [o for i, o in zip(ids, out, strict=True) if i != evil]
    assert all(isinstance(o, int) for o in acme), [type(o).__name__ for o in out]


def _peak_mb(dsn: str) -> dict[int, int]:
    """The peak resident memory (VmHWM, MB) of each backend of the test's pool (the server
    runs on this machine, as the tests' server does)."""
    with connect(dsn, autocommit=True) as conn:
        pids = [pid for pid, in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name LIKE 'attack3%%'")]
    peaks = {}
    for pid in pids:
        with open(f"/proc/{pid}/status") as status:
            peaks[pid] = next(int(line.split()[1]) // 1024 for line in status
                              if line.startswith("VmHWM"))
    return peaks


def test_a_batch_of_large_tool_results_costs_the_server_no_more_than_the_results(
        dsn: str) -> None:
    """64 runs' tool results of 1 MB each (RUNPOOL_MAX_MESSAGE_BYTES' default: what a tenant
    may always send) finish at once. As single statements a backend holds one 2 MB write at a
    time (peak ~10 MB over its start). As one batch statement the server parses one 128 MB
    JSON array (result and message content spliced twice into each element) into jsonb,
    then jsonb_to_recordset's rows: one backend peaks ~520 MB over its start (MAX_INFLIGHT
    such batches per worker at once). Expected: a batch costs a backend less than its
    payload."""
    ids = _held(dsn, MAX_BATCH + MAX_INFLIGHT)
    big = orjson.dumps({"text": "a" * ((1 << 20) - 20)})

    async def main() -> tuple[dict[int, int], dict[int, int]]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="attack3-batch")
        try:
            group = CommitGroup(pool)
            await asyncio.gather(*(group.write(_op(w), 30, what="test", statement=w)
                                   for w in _intents(ids)))
            before = await asyncio.to_thread(_peak_mb, dsn)
            writes = [checkpoints.result_write(
                i, 1, "t0", status="succeeded", result=jsonb(big), message_role="tool",
                message_content=jsonb(big), encoded=(big, big)) for i in ids]
            out = await asyncio.wait_for(asyncio.gather(*(
                group.write(_op(w), 60, what="test", statement=w) for w in writes),
                return_exceptions=True), 120)
            assert all(isinstance(o, int) for o in out), out
            return before, await asyncio.to_thread(_peak_mb, dsn)
        finally:
            await pool.close()

    before, after = asyncio.run(main())
    payload_mb = MAX_BATCH * 2 * len(big) >> 20
    growth = {pid: after[pid] - before.get(pid, 0) for pid in after}
    assert max(growth.values()) < payload_mb, (growth, payload_mb)


def _beside_a_batch(dsn: str, fillers: list[uuid.UUID], other: uuid.UUID,
                    writes: dict[str, checkpoints.Statement]) -> dict[str, str]:
    """MAX_INFLIGHT messages of `fillers` (they go alone at once), then a message of `other`
    without a first-try statement and the named `writes` (those wait and go together in one
    batch), through one CommitGroup. Each write's outcome by name: the type of its answer or
    error, or 'pending' if it had none within 30 s (each write's own deadline is 10 s)."""
    data = orjson.dumps({"turn": 1})

    async def plain(conn: psycopg.AsyncConnection[Any], tries: int) -> int:
        return await checkpoints.append_message(conn, other, 1, "assistant", jsonb(data))

    async def main() -> dict[str, str]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 1, name="attack3-batch")
        try:
            group = CommitGroup(pool)
            named = {f"filler {i}": group.write(_op(w), 10, what="test", statement=w)
                     for i, w in enumerate(_messages(fillers))}
            named["the other write"] = group.write(plain, 10, what="test")
            for name, w in writes.items():
                named[name] = group.write(_op(w), 10, what="test", statement=w)
            tasks = {asyncio.ensure_future(c): name for name, c in named.items()}
            _, pending = await asyncio.wait(tasks, timeout=30)
            for task in pending:
                task.cancel()
            return {tasks[t]: "pending" if t in pending else
                    type(t.exception() or t.result()).__name__ for t in tasks}
        finally:
            await pool.close()

    return asyncio.run(main())


def test_a_write_beside_a_failing_batch_statement_is_answered(dsn: str) -> None:
    """A batch of a write without a first-try statement (a repeat, a usage or wait write, or
    any write of a batch that failed before) and two tool results, one of them None (the
    batch statement fails: test_a_tool_returning_none...). _together requeues the failed
    batch statement's writes only: the other write is neither sent nor answered, and its
    caller (holding its run's write lock) waits forever. With tools returning None, a
    worker's runs hang this way within seconds. Expected: every write answered."""
    ids = _held(dsn, MAX_INFLIGHT + 3)
    fillers, other, results = ids[:MAX_INFLIGHT], ids[MAX_INFLIGHT], ids[MAX_INFLIGHT + 1:]
    out, _ = asyncio.run(_send(dsn, _intents(results)))
    assert out == [1, 1]
    answers = _beside_a_batch(dsn, fillers, other, {
        f"result {i}": w for i, w in enumerate(_results(results, [{"ok": 1}, None]))})
    assert set(answers.values()) == {"int"}, answers
    with connect(dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM runpool.messages WHERE run_id = %s",
                            (other,)).fetchone() == (1,)


def test_agents_whose_tools_return_none_all_finish(dsn: str) -> None:
    """32 runs of 6 turns (a tool call, a message) through one CommitGroup, as a worker's
    handlers make them, with a tool that returns None (a tool that only acts). Batches with
    a None result fail (test_a_tool_returning_none...), their writes are mixed with later
    first tries, and writes are lost (test_a_write_beside...): runs hang forever holding
    their write lock (seen: 5-19 of 32), and once, 9 runs failed with InvalidSqlStatementName
    ('prepared statement "_pg3_1" does not exist'). Expected: every run finishes."""
    ids = _held(dsn, 32)

    async def act(arguments: Any, key: str) -> None:
        return None

    async def main() -> tuple[int, list[str]]:
        pool = await open_pool(dsn, size=6, name="attack3-batch")
        try:
            group = CommitGroup(pool)

            async def agent(run_id: uuid.UUID) -> None:
                await agent_turns(pool, group, run_id, 6, "act", act)

            tasks = [asyncio.ensure_future(agent(i)) for i in ids]
            # A write's deadline is 30 s (Run's write_timeout): by 90 s every run is done.
            done, pending = await asyncio.wait(tasks, timeout=90)
            return len(pending), [repr(t.exception()) for t in done if t.exception()]
        finally:
            await pool.close()

    # Not asyncio.run: a hung run's tool result commit is shielded from cancellation
    # (finish_anyway) and its write is never answered, so its task would never end.
    loop = asyncio.new_event_loop()
    assert loop.run_until_complete(main()) == (0, [])
    loop.close()


def test_a_write_beside_a_batch_statement_the_database_fails_is_answered(dsn: str) -> None:
    """test_a_write_beside_a_failing_batch_statement..., with a batch statement that still
    fails once JSON nulls are stored: a message whose role breaks its CHECK (an empty role).
    Expected: that write gets its error, the other two land."""
    ids = _held(dsn, MAX_INFLIGHT + 3)
    fillers, other, messages = ids[:MAX_INFLIGHT], ids[MAX_INFLIGHT], ids[MAX_INFLIGHT + 1:]
    data = orjson.dumps({"turn": 1})
    out = _beside_a_batch(dsn, fillers, other, {
        f"role {role!r}": checkpoints.message_write(run_id, 1, role, jsonb(data), encoded=data)
        for role, run_id in zip(["assistant", ""], messages, strict=True)})
    assert out.pop("role ''") == "CheckViolation", out
    assert set(out.values()) == {"int"}, out


def test_writes_through_cut_connections_are_committed_once_each(dsn: str) -> None:
    """100 runs write 10 messages each, one after another, through one CommitGroup while a
    thread terminates one of its backends every 150 ms and another locks every run's row 50 ms
    out of 300 (as a heartbeat does). A cut that surfaced after a batch's COMMIT as an error
    without SQLSTATE ("cannot exit pipeline mode while busy", the connection not yet marked
    broken) had the batch sent again as first tries: 1-4 runs' messages stored twice in 2 of
    3 rounds (an attack on session 7's change). Expected: each run holds exactly the messages
    acknowledged to it, in order."""
    runs, turns = 100, 10
    ids = _held(dsn, runs)
    stop = threading.Event()

    def killer() -> None:
        with connect(dsn, autocommit=True) as conn:
            while not stop.wait(0.15):
                conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                             " WHERE datname = current_database()"
                             " AND application_name = 'attack3-cut' ORDER BY random() LIMIT 1")

    def heartbeat() -> None:
        with connect(dsn) as conn:
            while not stop.is_set():
                conn.execute("SELECT 1 FROM runpool.runs WHERE id = ANY(%s) ORDER BY id"
                             " FOR NO KEY UPDATE", (ids,))
                stop.wait(0.05)
                conn.commit()
                stop.wait(0.25)

    async def main() -> dict[uuid.UUID, int]:
        pool = await open_pool(dsn, size=MAX_INFLIGHT + 2, name="attack3-cut")
        try:
            group = CommitGroup(pool)

            async def one(run_id: uuid.UUID) -> int:
                for turn in range(turns):
                    # Repeated (a cut may come after a commit), it reads back first.
                    op, write = _message(run_id, {"turn": turn})
                    try:
                        await group.write(op, 20, what="test", statement=write)
                    except psycopg.Error:
                        return turn  # a write that failed for good: the run writes no more
                    await asyncio.sleep(random.uniform(0, 0.1))  # the agent's own work
                return turns

            done = await asyncio.wait_for(asyncio.gather(*(one(i) for i in ids)), 120)
            return dict(zip(ids, done, strict=True))
        finally:
            await pool.close()

    threads = [threading.Thread(target=killer), threading.Thread(target=heartbeat)]
    for thread in threads:
        thread.start()
    try:
        acknowledged = asyncio.run(main())
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    with connect(dsn, autocommit=True) as conn:
        stored = dict(conn.execute(
            "SELECT run_id, count(*) FILTER (WHERE (content ->> 'turn')::int = seq - 1)"
            " FROM runpool.messages WHERE run_id = ANY(%s) GROUP BY run_id", (ids,)).fetchall())
        extra = conn.execute("SELECT count(*) FROM runpool.messages WHERE run_id = ANY(%s)"
                             " AND (content ->> 'turn')::int <> seq - 1", (ids,)).fetchone()
    assert extra == (0,)
    assert {i: stored.get(i, 0) for i in ids} == acknowledged
