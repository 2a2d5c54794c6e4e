"""The host relay checks cancel notices against the database before passing any on
(runpool.relay_confirm): on a real LISTEN connection, forged notices are read and dropped, a real
cancel is passed on once however often it is named, and a read that cannot be made passes the
batch on unchecked instead of holding it (or the doorbells behind it)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import psycopg
import pytest

import runpool
from runpool import relay_confirm
from runpool.listener import Listener
from runpool.relay_confirm import CancelConfirm
from runpool.testing.hostile import notify_flood
from tests.helpers import claim_told, until

Script = Callable[[list[uuid.UUID], CancelConfirm], Awaitable[None]]


async def _relaying(dsn: str, script: Script) -> tuple[list[uuid.UUID], CancelConfirm]:
    """A Listener with the relay's check on `dsn`; once it listens, `script(passed_on, check)`
    sends notices and waits for what it needs; returns what was passed on, in order."""
    passed: list[uuid.UUID] = []
    check = CancelConfirm(passed.append)
    listener = Listener(dsn, asyncio.Event(), check.add, worker_id=uuid.uuid4(),
                        on_connect=check.reset, after_batch=check.flush)
    task = asyncio.create_task(listener.run())
    try:
        await asyncio.wait_for(listener.connected.wait(), 10)
        await script(passed, check)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return passed, check


async def _notify(dsn: str, **flood: Any) -> None:
    await asyncio.to_thread(notify_flood, dsn, **flood)


def _held(conn: psycopg.Connection, dsn: str, n: int) -> list[uuid.UUID]:
    """`n` runs claimed (held, with a lease) by a claim of the test's."""
    runs = [runpool.enqueue(conn, "acme", "noop", {}) for _ in range(n)]
    assert sorted(claim_told(dsn, n, [])) == sorted(runs)
    return runs


def test_relay_confirm__passes_on_only_held_runs_with_a_cancel_request_once_each(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough that a run named again and again is never passed on twice in this test.
    monkeypatch.setattr(relay_confirm, "FORWARD_SPACING", 3600.0)
    cancelled, uncancelled, last = _held(conn, dsn, 3)
    queued = runpool.enqueue(conn, "acme", "noop", {})
    for run_id in (cancelled, queued, last):  # the queued one ends at once: no lease
        conn.execute("SELECT runpool.cancel_run(%s, 'real')", (run_id,))

    async def script(passed: list[uuid.UUID], _check: CancelConfirm) -> None:
        # 2,000 random ids; the held run with no request and the ended one, 20 times each;
        # the real cancel 20 times; each named in a transaction of its own.
        await _notify(dsn, cancels=2_000, named=[uncancelled, queued, cancelled],
                      named_each=20)
        # Notices are read and checked in order: once the last is passed on, all were.
        await _notify(dsn, named=[last], named_each=1)
        await until(lambda: last in passed, what="the last notice passed on")

    passed, check = asyncio.run(_relaying(dsn, script))
    assert passed == [cancelled, last]
    assert check.unconfirmed >= 2_002  # a name repeated within a batch is read once
    assert check.dropped == 0


def test_relay_confirm__a_run_named_again_after_the_spacing_is_passed_on_again(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_confirm, "FORWARD_SPACING", 0.0)
    (run_id,) = _held(conn, dsn, 1)
    conn.execute("SELECT runpool.cancel_run(%s, 'real')", (run_id,))

    async def script(passed: list[uuid.UUID], _check: CancelConfirm) -> None:
        def reached(n: int) -> Callable[[], bool]:
            return lambda: len(passed) >= n

        for n in (1, 2, 3):  # one at a time: each its own batch
            await _notify(dsn, named=[run_id], named_each=1)
            await until(reached(n), what=f"notice {n} passed on")

    passed, _ = asyncio.run(_relaying(dsn, script))
    assert passed == [run_id] * 3


def test_relay_confirm__a_read_held_by_a_lock_times_out_and_passes_notices_on_unchecked(
        conn: psycopg.Connection, dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A migration's lock on the runs table must not hold the notices (nor the doorbells that
    share the connection) for longer than the read's timeout: past it, the batch goes on
    unchecked, as before the check (each worker reads the flags of what it is sent), and so
    do the batches after it for RECHECK_SECONDS, with no read to wait for."""
    caplog.set_level(logging.WARNING, logger="runpool.relay")
    first, second = [uuid.uuid4() for _ in range(3)], [uuid.uuid4() for _ in range(2)]

    async def script(passed: list[uuid.UUID], _check: CancelConfirm) -> None:
        await _notify(dsn, named=first, named_each=1)
        await until(lambda: len(passed) == 3, what="the batch passed on unchecked")
        await _notify(dsn, named=second, named_each=1)
        await until(lambda: len(passed) == 5, what="the next batch, with no read")

    with psycopg.connect(dsn) as locker:  # a transaction of its own, held
        locker.execute("LOCK TABLE runpool.runs IN ACCESS EXCLUSIVE MODE")
        passed, check = asyncio.run(_relaying(dsn, script))
        locker.rollback()
    assert sorted(passed[:3]) == sorted(first) and sorted(passed[3:]) == sorted(second)
    assert check.failed_reads == 1 and check.unconfirmed == 0
    failures = [r for r in caplog.records
                if getattr(r, "action", "") == "relay_cancel_check_failed"]
    assert len(failures) == 1 and "statement timeout" in failures[0].getMessage()


def test_relay_confirm__a_full_backlog_drops_what_it_cannot_hold_and_counts_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_confirm, "PENDING_MAX", 3)
    check = CancelConfirm(lambda _run_id: None)
    for _ in range(5):
        check.add(uuid.uuid4())
    assert check.dropped == 2
    check.reset()  # a new connection: the workers read every flag themselves
    assert check.dropped == 5

