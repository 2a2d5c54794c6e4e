"""The host relay checks cancel notices against the database before passing any on
(runpool.relay_confirm), on a connection of its own: fed by a real LISTEN connection, forged
notices are read and dropped, a real cancel is passed on once however often it is named, more
notices than a read takes become a recheck for every worker, and so do notices whose read
fails (a lock, a killed connection), instead of being held or let through unchecked."""

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
from runpool.relay_confirm import CONFIRM_NAME, CancelConfirm
from runpool.testing.hostile import notify_flood
from tests.helpers import claim_told, scalar, until, wait_for


class _Relay:
    """A CancelConfirm checking on `dsn`, fed by a Listener on `dsn`: what it passed on, in
    order, and how many rechecks it asked for."""

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.passed: list[uuid.UUID] = []
        self.rechecks = 0
        self.check = CancelConfirm(dsn, stateless=False, forward=self.passed.append,
                                   recheck=self._recheck)

    def _recheck(self) -> None:
        self.rechecks += 1

    async def notify(self, **flood: Any) -> None:
        await asyncio.to_thread(notify_flood, self.dsn, **flood)


Script = Callable[[_Relay], Awaitable[None]]


def _relaying(dsn: str, script: Script) -> _Relay:
    """Run `script(relay)` once the relay's Listener listens; the relay afterwards."""
    relay = _Relay(dsn)

    async def main() -> None:
        listener = Listener(dsn, asyncio.Event(), relay.check.add, worker_id=uuid.uuid4(),
                            on_connect=relay.check.reset)
        tasks = [asyncio.create_task(listener.run()), asyncio.create_task(relay.check.run())]
        try:
            await asyncio.wait_for(listener.connected.wait(), 10)
            await script(relay)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    return relay


def _held(conn: psycopg.Connection, dsn: str, n: int) -> list[uuid.UUID]:
    """`n` runs claimed (held, with a lease) by a claim of the test's."""
    runs = [runpool.enqueue(conn, "acme", "noop", {}) for _ in range(n)]
    assert sorted(claim_told(dsn, n, [])) == sorted(runs)
    return runs


def _cancel(conn: psycopg.Connection, *run_ids: uuid.UUID) -> None:
    for run_id in run_ids:
        conn.execute("SELECT runpool.cancel_run(%s, 'real')", (run_id,))


def test_relay_confirm__passes_on_only_held_runs_with_a_cancel_request_once_each(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Long enough that a run named again and again is never passed on twice in this test.
    monkeypatch.setattr(relay_confirm, "FORWARD_SPACING", 3600.0)
    cancelled, uncancelled, last = _held(conn, dsn, 3)
    queued = runpool.enqueue(conn, "acme", "noop", {})
    _cancel(conn, cancelled, queued, last)  # the queued one ends at once: no lease

    async def script(relay: _Relay) -> None:
        # 2,000 random ids; the held run with no request and the ended one, 20 times each;
        # the real cancel 20 times; each named in a transaction of its own.
        await relay.notify(cancels=2_000, named=[uncancelled, queued, cancelled], named_each=20)
        # Notices are read and checked in order: once the last is passed on, all were.
        await relay.notify(named=[last], named_each=1)
        await until(lambda: last in relay.passed, what="the last notice passed on")

    relay = _relaying(dsn, script)
    assert relay.passed == [cancelled, last]
    assert relay.check.unconfirmed >= 2_002  # a name repeated before its read is read once
    assert relay.check.dropped == 0 and relay.rechecks == 0


def test_relay_confirm__a_run_named_again_after_the_spacing_is_passed_on_again(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_confirm, "FORWARD_SPACING", 0.0)
    (run_id,) = _held(conn, dsn, 1)
    _cancel(conn, run_id)

    async def script(relay: _Relay) -> None:
        def reached(n: int) -> Callable[[], bool]:
            return lambda: len(relay.passed) >= n

        for n in (1, 2, 3):  # one at a time: each its own read
            await relay.notify(named=[run_id], named_each=1)
            await until(reached(n), what=f"notice {n} passed on")

    assert _relaying(dsn, script).passed == [run_id] * 3


def test_relay_confirm__notices_past_what_waits_for_a_read_become_a_recheck(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More notices than wait for one read: the rest are dropped and every worker is asked to
    read its runs' flags instead, so a real cancel among them still lands (and a flood
    faster than the reads never piles up in memory)."""
    monkeypatch.setattr(relay_confirm, "BATCH", 3)
    (cancelled,) = _held(conn, dsn, 1)
    _cancel(conn, cancelled)
    relay = _Relay(dsn)

    async def main() -> None:
        # Added on the loop with no turn between: the reading task has taken none yet.
        for run_id in [uuid.uuid4(), uuid.uuid4(), uuid.uuid4(), cancelled, uuid.uuid4()]:
            relay.check.add(run_id)
        assert (relay.check.dropped, relay.rechecks) == (2, 2)
        task = asyncio.create_task(relay.check.run())
        try:
            await until(lambda: relay.check.unconfirmed == 3, what="the 3 read")
            relay.check.add(cancelled)  # named again: read this time
            await until(lambda: relay.passed == [cancelled], what="the real cancel")
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())


def test_relay_confirm__a_read_held_by_a_lock_times_out_and_notices_become_a_recheck(
        conn: psycopg.Connection, dsn: str, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A migration's lock on the runs table must not hold the cancels: past the read's
    timeout the workers are asked to read their runs' flags instead, and so are they for the
    notices of the next UNCHECKED_SECONDS, with no read. Nothing goes on unchecked: a flood
    let through would fill the workers' queues."""
    monkeypatch.setattr(relay_confirm, "READ_SECONDS", 0.5)
    caplog.set_level(logging.WARNING, logger="runpool.relay")

    async def script(relay: _Relay) -> None:
        await relay.notify(cancels=3)
        await until(lambda: relay.rechecks == 1, what="a recheck for the first")
        await relay.notify(cancels=2)
        await until(lambda: relay.rechecks == 2, what="a recheck for the next, with no read")

    with psycopg.connect(dsn) as locker:  # a transaction of its own, held
        locker.execute("LOCK TABLE runpool.runs IN ACCESS EXCLUSIVE MODE")
        relay = _relaying(dsn, script)
        locker.rollback()
    assert relay.passed == []
    assert relay.check.failed_reads == 1 and relay.check.unconfirmed == 0
    failures = [r for r in caplog.records
                if getattr(r, "action", "") == "relay_cancel_check_failed"]
    assert len(failures) == 1, failures


# The relay's check connection, seen from the server.
CHECKER_PIDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE %s
"""


def test_relay_confirm__a_killed_check_connection_is_replaced_after_the_unchecked_spell(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(relay_confirm, "UNCHECKED_SECONDS", 0.0)

    async def script(relay: _Relay) -> None:
        await relay.notify(cancels=1)
        await until(lambda: relay.check.unconfirmed == 1, what="a first read")
        (pid,) = await asyncio.to_thread(
            wait_for, lambda: [p for (p,) in conn.execute(CHECKER_PIDS, (CONFIRM_NAME + "@%",))],
            what="the check connection")
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
        await relay.notify(cancels=1)  # its read fails: a recheck
        await until(lambda: relay.rechecks == 1, what="a recheck")
        await relay.notify(cancels=1)  # read on a new connection
        await until(lambda: relay.check.unconfirmed == 2, what="a read again")

    relay = _relaying(dsn, script)
    assert relay.check.failed_reads == 1 and relay.passed == []
    assert scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE %s",
                  CONFIRM_NAME + "@%") == 0  # closed with the relay
