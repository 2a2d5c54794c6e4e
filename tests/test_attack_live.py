"""Attacks on live runs (wait, follow, progress) and on the migration that brought them: a silent
network, hostile inputs, an operator upgrading a database with history."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

import runpool
from checkpoints.store import INSERT_MESSAGE
from runpool import live
from runpool.db import aconnect, connect
from runpool.enqueue import enqueue
from runpool.testing import Proxy, wait_for

from .helpers import migrate_below, running_pool, status_of


def _running(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> None:
    """The run as a worker holds it (no pool needed: nothing here must finish it)."""
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() + interval '10 minutes' WHERE id = %s", (run_id,))


def _in_thread(fn: Any, bound: float) -> BaseException | None:
    """What fn() raised, or None; fails if it is still blocked after `bound` seconds (a hang)."""
    outcome: list[BaseException | None] = []

    def go() -> None:
        try:
            fn()
            outcome.append(None)
        except BaseException as exc:  # what it raised is the test's subject
            outcome.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    thread.join(bound)
    assert not thread.is_alive(), f"still blocked after {bound} s: it hangs"
    return outcome[0]


def test_wait_and_follow__a_silent_network_fails_them_instead_of_hanging(
        dsn: str, server_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A black-holed path (a dead NAT entry, a partition: no error, no answer) must not hang a
    waiter past its timeout, nor a follower forever: the unanswered read is cut."""
    monkeypatch.setattr(live, "READ_SECONDS", 1.5)
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        _running(conn, run_id)
    proxy = Proxy(server_dsn)
    try:
        # wait(timeout=1): TimeoutError, within its timeout and the grace of a cut read.
        waiter = psycopg.connect(proxy.dsn(dsn), autocommit=True)
        threading.Timer(0.3, proxy.blackholed.set).start()
        started = time.monotonic()
        raised = _in_thread(lambda: live.wait(waiter, run_id, timeout=1, poll=0.2), 10)
        assert isinstance(raised, TimeoutError), repr(raised)
        assert time.monotonic() - started < 1 + live.GRACE_SECONDS + 2
        waiter.close()
        proxy.blackholed.clear()

        async def wait_async() -> None:
            aconn = await psycopg.AsyncConnection.connect(proxy.dsn(dsn), autocommit=True)
            asyncio.get_running_loop().call_later(0.3, proxy.blackholed.set)
            try:
                await live.wait_async(aconn, run_id, timeout=1, poll=0.2)
            finally:
                await aconn.close()

        raised = _in_thread(lambda: asyncio.run(wait_async()), 10)
        assert isinstance(raised, TimeoutError), repr(raised)
        proxy.blackholed.clear()

        # No timeout at all (wait forever, follow): a read unanswered for READ_SECONDS fails
        # the connection like a cut, so the caller reconnects and resumes.
        async def follow() -> None:
            aconn = await psycopg.AsyncConnection.connect(proxy.dsn(dsn), autocommit=True)
            try:
                async for event in live.follow(aconn, run_id, poll=0.2):
                    if event.seq == 2:
                        proxy.blackholed.set()
            finally:
                await aconn.close()

        raised = _in_thread(lambda: asyncio.run(follow()), 10)
        assert isinstance(raised, psycopg.OperationalError), repr(raised)
        proxy.blackholed.clear()

        waiter = psycopg.connect(proxy.dsn(dsn), autocommit=True)
        threading.Timer(0.3, proxy.blackholed.set).start()
        raised = _in_thread(lambda: live.wait(waiter, run_id, poll=0.2), 10)
        assert isinstance(raised, psycopg.OperationalError), repr(raised)
        waiter.close()
    finally:
        proxy.close()
    # A healthy connection is never cut: a wait longer than READ_SECONDS just waits.
    with connect(dsn, autocommit=True) as conn:
        threading.Timer(2.0, lambda: _finish(dsn, run_id)).start()
        assert live.wait(conn, run_id, timeout=10, poll=0.5).status == "succeeded"


def _finish(dsn: str, run_id: uuid.UUID) -> None:
    with connect(dsn, autocommit=True) as conn:
        conn.execute("UPDATE runpool.runs SET status = 'succeeded', result = '1',"
                     " finished_at = now(), lease_expires_at = NULL WHERE id = %s", (run_id,))


def test_wait_and_follow__a_bad_tenant_is_invalid_input(dsn: str) -> None:
    bad = ["a\x00b", "x" * 201, ""]
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        for tenant in bad:
            with pytest.raises(runpool.InvalidInput, match="tenant"):
                live.wait(conn, run_id, timeout=1, tenant=tenant)

        async def follow() -> None:
            async with await aconnect(dsn, autocommit=True) as aconn:
                for tenant in bad:
                    with pytest.raises(runpool.InvalidInput, match="tenant"):
                        await live.wait_async(aconn, run_id, timeout=1, tenant=tenant)
                    with pytest.raises(runpool.InvalidInput, match="tenant"):
                        async for _ in live.follow(aconn, run_id, tenant=tenant):
                            pass

        asyncio.run(follow())


def test_upgrade__0009_rewrites_no_run_row_so_its_lock_lasts_no_longer_with_history(
        empty_dsn: str) -> None:
    """0009 holds runs ACCESS EXCLUSIVE (its ALTER) until it commits: every claim, heartbeat
    and outcome of a live fleet waits meanwhile. An UPDATE of every run that ever finished
    (measured: 6 s of the 8.8 s for 500,000 finished runs) made that outage grow with the
    history; the history's rows must stay as they were (same version: not rewritten)."""
    from runpool.migrate import migrate

    with connect(empty_dsn, autocommit=True) as conn:
        migrate_below(conn, 9)
        # Through the SQL of 0008 (Python's enqueue speaks to the latest schema's).
        done, failed, retried, waiting = (
            conn.execute("SELECT runpool.enqueue('acme', 'noop')").fetchone()[0]  # type: ignore[index]
            for _ in range(4))
        conn.execute("UPDATE runpool.runs SET status = 'succeeded', attempt = 1, result = '7',"
                     " finished_at = now() WHERE id = %s", (done,))
        conn.execute("UPDATE runpool.runs SET status = 'failed', attempt = 3,"
                     " error = '{\"reason\": \"x\"}', finished_at = now() WHERE id = %s",
                     (failed,))
        conn.execute("UPDATE runpool.runs SET attempt = 1 WHERE id = %s", (retried,))
        history = "SELECT xmin::text, ctid::text FROM runpool.runs WHERE id = ANY(%s) ORDER BY id"
        before = conn.execute(history, ([done, failed],)).fetchall()
        assert [m.version for m in migrate(conn)][:1] == [9]
        assert conn.execute(history, ([done, failed],)).fetchall() == before
        seqs = dict(conn.execute("SELECT id, event_seq FROM runpool.runs").fetchall())
        assert seqs == {done: 2, failed: 2, retried: 2, waiting: 1}
        # New runs start at 1 as before.
        fresh = enqueue(conn, "acme", "noop")
        assert conn.execute("SELECT event_seq FROM runpool.runs WHERE id = %s",
                            (fresh,)).fetchone() == (1,)
        assert runpool.wait(conn, failed, timeout=5).status == "failed"
    replays = {r: asyncio.run(_replay(empty_dsn, r)) for r in (done, failed, retried, waiting)}
    assert replays == {done: [(1, "queued"), (2, "succeeded")],
                       failed: [(1, "queued"), (2, "failed")],
                       retried: [(1, "queued"), (2, "queued")],
                       waiting: [(1, "queued")]}


async def _replay(dsn: str, run_id: uuid.UUID) -> list[tuple[int, str]]:
    """The status events a follower gets now (it stops at the last one stored)."""
    async with await aconnect(dsn, autocommit=True) as aconn:
        cur = await aconn.execute(live.EVENTS, live.Stream(run_id, 0, 1, None).params())
        return sorted((seq, data["status"]) for _, kind, seq, data, _ in await cur.fetchall()
                      if kind == "status")


@pytest.mark.parametrize("level", [psycopg.IsolationLevel.REPEATABLE_READ,
                                   psycopg.IsolationLevel.SERIALIZABLE])
def test_cancel_run_in_repeatable_read__a_checkpoint_write_in_flight_does_not_fail_it(
        dsn: str, level: psycopg.IsolationLevel) -> None:
    """A caller whose transactions are REPEATABLE READ or SERIALIZABLE cancels a run while its
    worker commits a checkpoint. Before 0009 the write only share-locked the run row (its
    fence), so cancel_run waited and then went ahead; a write that UPDATEs the run row (to
    number its event) makes every such cancel fail with a serialization failure (measured with
    a real pool of agent runs: 20 of 40 REPEATABLE READ cancels failed, 0 of 40 before)."""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        _running(conn, run_id)
        with connect(dsn) as worker, connect(dsn) as caller:
            # The worker's very statement (fence and insert), its transaction not yet committed.
            worker.execute(INSERT_MESSAGE, {"run_id": run_id, "attempt": 1, "events": 1,
                                            "role": "assistant", "content": '"hi"'})
            caller.isolation_level = level
            caller_pid = caller.info.backend_pid
            answer: list[Any] = []

            def cancel() -> None:
                try:
                    answer.append(caller.execute("SELECT runpool.cancel_run(%s, 'stop')",
                                                 (run_id,)).fetchone())
                    caller.commit()
                except psycopg.Error as exc:
                    answer.append(exc)

            thread = threading.Thread(target=cancel)
            thread.start()
            # The cancel waits for the worker's lock (its snapshot is taken: the case at hand).
            wait_for(lambda: conn.execute("SELECT wait_event_type = 'Lock' FROM"
                                          " pg_stat_activity WHERE pid = %s",
                                          (caller_pid,)).fetchone() == (True,),
                     timeout=10, what="the cancel waiting for the worker's row lock")
            worker.commit()
            thread.join(10)
        assert answer == [("cancelling",)], answer
        # The message is numbered after the run's 'running' (seq 2), the follower sees it.
        assert [(s, k) for s, k in asyncio.run(_kinds(dsn, run_id))] == [
            (1, "status"), (2, "status"), (3, "message")]


async def _kinds(dsn: str, run_id: uuid.UUID) -> list[tuple[int, str]]:
    async with await aconnect(dsn, autocommit=True) as aconn:
        cur = await aconn.execute(live.EVENTS, live.Stream(run_id, 0, 1, None).params())
        return sorted((seq, kind) for _, kind, seq, _, _ in await cur.fetchall()
                      if kind not in ("run", "progress"))


def test_web_run_row__reports_the_last_event_seq_of_a_run_that_wrote_checkpoints(
        dsn: str) -> None:
    """The console's run page starts its live stream after the run row's event_seq, and the
    event stream answers 204 once a terminal run's client is past it: it must be the run's
    last seq, also when its checkpoints are numbered in event_seqs (a stale one replays what
    the page shows, or ends a stream before the events after it)."""
    from runpool.web.sql import SQL

    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        _running(conn, run_id)
        for i in (1, 2, 3):
            conn.execute(INSERT_MESSAGE, {"run_id": run_id, "attempt": 1, "events": 1,
                                          "role": "assistant", "content": str(i)})
        (row,) = conn.execute(SQL["run"], {"id": run_id, "tenant": None}).fetchall()
    last = max(seq for seq, _ in asyncio.run(_kinds(dsn, run_id)))
    assert last == 5
    assert row[0]["event_seq"] == last


def test_doorbell__goes_quiet_past_the_notification_queue_bound_and_writes_still_commit(
        dsn: str) -> None:
    """A session that LISTENs and never reads on (idle in a transaction: any login may do it)
    holds the server's notification queue back; once it is full every NOTIFY fails its
    transaction, and each checkpoint write rings a doorbell. Past the bound (half the queue
    by default; runpool.notify_queue_limit, set here to the queue's usage right now, so the
    bound is crossed without writing gigabytes) the doorbell stays silent and the write
    commits; followers poll. Under the bound it rings as before."""
    with connect(dsn, autocommit=True) as conn, connect(dsn, autocommit=True) as listener:
        run_id = enqueue(conn, "acme", "noop")
        _running(conn, run_id)
        listener.execute(f"LISTEN {live.channel(run_id)}")
        stuck = connect(dsn)  # listening somewhere, idle in a transaction: holds the queue
        stuck.execute("LISTEN runpool_attack_stuck")
        stuck.commit()
        stuck.execute("SELECT 1")
        try:
            with connect(dsn, autocommit=True) as worker:
                worker.execute("NOTIFY runpool_attack_stuck")  # the queue is in use now
                worker.execute("SELECT set_config('runpool.notify_queue_limit',"
                               " pg_notification_queue_usage()::text, false)")
                for i in (1, 2):
                    worker.execute(INSERT_MESSAGE, {"run_id": run_id, "attempt": 1, "events": 1,
                                                    "role": "assistant", "content": str(i)})
                assert list(listener.notifies(timeout=0.5)) == []  # silent, yet committed
                worker.execute("RESET runpool.notify_queue_limit")
                worker.execute(INSERT_MESSAGE, {"run_id": run_id, "attempt": 1, "events": 1,
                                                "role": "assistant", "content": "3"})
                got = list(listener.notifies(timeout=5, stop_after=1))
                assert [n.channel for n in got] == [live.channel(run_id)]
        finally:
            stuck.close()
        assert conn.execute("SELECT count(*) FROM runpool.messages WHERE run_id = %s",
                            (run_id,)).fetchone() == (3,)


def test_progress__a_run_reporting_in_a_loop_lets_its_worker_serve_others_and_cancel_it(
        dsn: str) -> None:
    """`await run.progress(...)` in a loop that awaits nothing else (a handler streaming tokens
    from a list, reporting while it polls a flag): the worker's other runs (another tenant's),
    its heartbeat and its cancel notices share that event loop; progress must let them in."""
    with connect(dsn, autocommit=True) as conn, running_pool(dsn, concurrency=4):
        spinner = enqueue(conn, "acme", "progress_spin")
        wait_for(lambda: status_of(conn, spinner) == "running", timeout=15,
                 what="the spinning run")
        other = enqueue(conn, "globex", "noop")
        assert runpool.wait(conn, other, timeout=15).status == "succeeded"
        assert conn.execute("SELECT runpool.cancel_run(%s, 'enough')",
                            (spinner,)).fetchone() == ("cancelling",)
        assert runpool.wait(conn, spinner, timeout=15).status == "cancelled"
