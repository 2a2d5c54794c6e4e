"""The connection budget of a host (issue 19): one LISTEN connection for all of a host's
worker processes (the supervisor's listener process relays notices to them), and a cap on
the host's work connections, shared evenly; `status` counts them per host."""

from __future__ import annotations

import os
import re
import signal
import socket
from typing import Any

import psycopg
import pytest

import runpool
from runpool.status import collect, render
from runpool.testing.hostile import notify_flood
from tests.helpers import running_pool, scalar, wait_for

LISTENERS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE 'LISTEN runpool_wakeup%%'
"""
# When the host's LISTEN connection (re)connected.
LISTEN_STARTED = """
SELECT max(backend_start) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE 'LISTEN runpool_wakeup%%'
"""
# runpool's connections to this database (the test's own are not named runpool-...).
RUNPOOL_CONNECTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'runpool-%%'
"""


def _count(conn: psycopg.Connection[Any], ids: list[Any], status: str) -> int:
    return int(scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                            " AND status = %s", ids, status))


def test_budget__one_listen_connection_per_host_wakes_and_cancels_every_worker(
        conn: psycopg.Connection, dsn: str) -> None:
    # 3 workers, 9 connections for the host: 2 pooled + 1 heartbeat each; and the listener
    # process's 2: LISTEN, and the check of cancel notices (counted as work).
    # Polls and heartbeats far apart: only relayed wake-ups and notices can be quick.
    with running_pool(dsn, workers=3, concurrency=2, host_connections=9, poll_seconds=60,
                      lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.workers"
                                      " WHERE stopped_at IS NULL") == 3, what="3 workers")
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        holds = []
        for _ in range(6):  # one at a time: each start is a wake-up's doing
            holds.append(runpool.enqueue(conn, "acme", "hold", {}))
        wait_for(lambda: _count(conn, holds, "running") == 6, timeout=10,
                 what="6 runs started by relayed wake-ups")
        # 2 slots per worker: every worker heard the doorbells.
        assert scalar(conn, "SELECT count(DISTINCT worker_id) FROM runpool.runs"
                            " WHERE id = ANY(%s)", holds) == 3
        report = collect(conn)
        assert report["connections"] == [{
            "host": socket.gethostname(), "listen": 1, "heartbeat": 3, "work": 7, "total": 11}]
        assert "1 + 3 + 7 = 11" in render(report)
        assert scalar(conn, RUNPOOL_CONNECTIONS) == 11
        for run_id in holds:
            conn.execute("SELECT runpool.cancel_run(%s, 'test')", (run_id,))
        wait_for(lambda: _count(conn, holds, "cancelled") == 6, timeout=10,
                 what="cancels relayed to every worker")
        assert scalar(conn, LISTENERS) == 1
        assert "action=listen_lost" not in pool.log()


def test_budget__a_lone_worker_holds_the_listen_connection_itself_and_hears_everything(
        conn: psycopg.Connection, dsn: str) -> None:
    # No listener process to relay through: one LISTEN connection for the host all the same,
    # and each wake-up is one process hop shorter (W2).
    with running_pool(dsn, workers=1, concurrency=2, poll_seconds=60, lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        wait_for(lambda: len(pool.workers()) == 1, what="1 worker")
        assert pool.listener() is None
        hold = runpool.enqueue(conn, "acme", "hold", {})
        wait_for(lambda: _count(conn, [hold], "running") == 1, timeout=10,
                 what="a run started by its doorbell")
        conn.execute("SELECT runpool.cancel_run(%s, 'test')", (hold,))
        wait_for(lambda: _count(conn, [hold], "cancelled") == 1, timeout=10,
                 what="a cancel heard by the worker")
        assert scalar(conn, LISTENERS) == 1 and scalar(conn, RUNPOOL_CONNECTIONS) == 1 + 1 + 4


def test_budget__a_killed_listener_process_is_restarted_and_the_workers_hear_it(
        conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, workers=2, concurrency=2, poll_seconds=60, lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        wait_for(lambda: len(pool.workers()) == 2, what="2 workers")
        workers = set(pool.workers())
        listener = pool.listener()
        assert listener is not None and listener not in workers
        os.kill(listener, signal.SIGKILL)
        wait_for(lambda: pool.listener() not in (None, listener), what="a new listener")
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="its LISTEN connection")
        # The workers that lived on hear the new listener's doorbells (polls are 60 s apart).
        for _ in range(3):
            run_id = runpool.enqueue(conn, "acme", "noop", {})
            wait_for(lambda rid=run_id: scalar(  # type: ignore[misc]
                conn, "SELECT status FROM runpool.runs WHERE id = %s", rid) == "succeeded",
                timeout=10, what="a run woken by the new listener")
        assert set(pool.workers()) == workers
        assert len(re.findall(r"started the host's listener", pool.log())) == 2


def test_budget__doorbells_rung_while_the_listener_is_dead_are_not_lost_for_a_poll(
        conn: psycopg.Connection, dsn: str) -> None:
    """Runs enqueued between the listener's SIGKILL and its successor's LISTEN ring doorbells
    nobody hears; the new listener tells every worker to claim once, so they start long before
    the workers' next poll (60 s), and nobody enqueues anything after them to ring again."""
    with running_pool(dsn, workers=2, concurrency=2, poll_seconds=60, lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        # Both workers past their first claim, asleep until a doorbell.
        wait_for(lambda: pool.log().count("worker started") == 2, what="2 workers")
        warm = runpool.enqueue(conn, "acme", "noop", {})
        wait_for(lambda: _count(conn, [warm], "succeeded") == 1, what="a first run")
        listener = pool.listener()
        assert listener is not None
        os.kill(listener, signal.SIGKILL)
        wait_for(lambda: scalar(conn, LISTENERS) == 0, what="the LISTEN connection gone")
        ids = [runpool.enqueue(conn, "acme", "noop", {}) for _ in range(3)]
        wait_for(lambda: _count(conn, ids, "succeeded") == 3, timeout=20,
                 what="runs enqueued while the listener was dead, started within a poll")
        # Their doorbells rang before the new listener listened (nobody heard them), and they
        # were claimed once it did: its catch-up, not a poll, started them.
        listening = scalar(conn, LISTEN_STARTED)
        assert listening > scalar(
            conn, "SELECT max(created_at) FROM runpool.runs WHERE id = ANY(%s)", ids)
        assert listening < scalar(
            conn, "SELECT min(started_at) FROM runpool.runs WHERE id = ANY(%s)", ids)
        wait_for(lambda: pool.listener() not in (None, listener), what="a new listener")


def test_budget__a_forged_notice_flood_through_the_listener_process_breaks_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    """Any login may NOTIFY: 20,000 forged cancels, 5,000 malformed ones, 100 cancels for each
    running run (whose flags are not set) and 2,000 doorbells go through the one listener to
    3 workers; the listener lives on, no run is cancelled, a real run still starts on its
    doorbell and a real cancel still lands."""
    with running_pool(dsn, workers=3, concurrency=2, poll_seconds=60, lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        wait_for(lambda: len(pool.workers()) == 3, what="3 workers")
        listener = pool.listener()
        holds = [runpool.enqueue(conn, "acme", "hold", {}) for _ in range(3)]
        wait_for(lambda: _count(conn, holds, "running") == 3, timeout=10, what="holds running")
        notify_flood(dsn, cancels=20_000, noise=5_000, named=holds, named_each=100,
                     wakeups=2_000)
        run_id = runpool.enqueue(conn, "acme", "noop", {})
        wait_for(lambda: scalar(conn, "SELECT status FROM runpool.runs WHERE id = %s",
                                run_id) == "succeeded", timeout=15,
                 what="a real run after the flood")
        assert _count(conn, holds, "running") == 3
        conn.execute("SELECT runpool.cancel_run(%s, 'real')", (holds[0],))
        wait_for(lambda: _count(conn, holds[:1], "cancelled") == 1, timeout=10,
                 what="a real cancel after the flood")
        assert pool.listener() == listener
        assert "relay_failed" not in pool.log() and "Traceback" not in pool.log()


def test_budget__a_doorbell_behind_a_flood_of_forged_cancels_still_wakes_stopped_workers(
        conn: psycopg.Connection, dsn: str) -> None:
    """Workers that read their relay sockets slowly (here: stopped) once had their queues
    filled by forged cancel notices, and a doorbell rung then was dropped. The relay now drops
    forged cancels itself (it checks each against the database), so the doorbell of a run
    enqueued behind 3,000 of them waits in the queue and the run starts on it, not on the
    next poll."""
    # Two workers: a lone worker listens itself, with no relay between.
    with running_pool(dsn, workers=2, concurrency=2, poll_seconds=60,
                      lease_seconds=120) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        # Past their first claims (each claims once as it starts): one run done after both
        # said they started.
        wait_for(lambda: pool.log().count("action=worker_started") == 2, what="both started")
        first = runpool.enqueue(conn, "acme", "noop", {})
        wait_for(lambda: scalar(conn, "SELECT status FROM runpool.runs WHERE id = %s",
                                first) == "succeeded", what="a first run")
        pids = pool.workers()
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        try:
            # More than a worker's queue holds (278 datagrams by default), one transaction.
            notify_flood(dsn, cancels=3_000)
            run_id = runpool.enqueue(conn, "acme", "noop", {})
            wait_for(lambda: "action=relay_cancel_unconfirmed" in pool.log(),
                     what="the relay dropping the forged cancels")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
        wait_for(lambda: scalar(conn, "SELECT status FROM runpool.runs WHERE id = %s",
                                run_id) == "succeeded", timeout=15,
                 what="the run started on its doorbell")
        # No forged cancel reached a worker's queue.
        assert "action=relay_notice_kept" not in pool.log()
        assert "Traceback" not in pool.log()


@pytest.mark.parametrize("forged", [3_000, 300_000])
def test_budget__a_real_cancel_behind_a_flood_of_forged_ones_reaches_a_stopped_worker(
        conn: psycopg.Connection, dsn: str, forged: int) -> None:
    """A real cancel sent behind forged ones, while the worker of its run reads nothing
    (stopped), lands as soon as it reads again, not at its next heartbeat (lease 300 s: 100 s
    away). Before the relay checked cancels, 3,000 forged ones filled that worker's queue and
    the real one was dropped; 300,000 at once are more than the relay reads in one go, so it
    drops the rest and asks the workers to read their flags instead (a first version dropped
    the real cancel with them)."""
    with running_pool(dsn, workers=2, concurrency=2, poll_seconds=60,
                      lease_seconds=300) as pool:
        wait_for(lambda: scalar(conn, LISTENERS) == 1, what="the host's LISTEN connection")
        wait_for(lambda: pool.log().count("action=worker_started") == 2, what="both started")
        hold = runpool.enqueue(conn, "acme", "hold", {})
        wait_for(lambda: _count(conn, [hold], "running") == 1, timeout=10, what="hold running")
        pid = scalar(conn, "SELECT w.pid FROM runpool.runs r JOIN runpool.workers w"
                           " ON w.id = r.worker_id WHERE r.id = %s", hold)
        assert pid in pool.workers()
        os.kill(pid, signal.SIGSTOP)
        try:
            notify_flood(dsn, cancels=forged)
            conn.execute("SELECT runpool.cancel_run(%s, 'real')", (hold,))
            # The relay is past the cancel: the other worker ran a run enqueued after it.
            marker = runpool.enqueue(conn, "acme", "noop", {})
            wait_for(lambda: _count(conn, [marker], "succeeded") == 1, timeout=20,
                     what="a run enqueued after the cancel, on the other worker")
            wait_for(lambda: "action=relay_cancel_unconfirmed" in pool.log(),
                     what="the relay dropping the forged cancels")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: _count(conn, [hold], "cancelled") == 1, timeout=15,
                 what="the real cancel, long before the heartbeat")
        assert "Traceback" not in pool.log()
