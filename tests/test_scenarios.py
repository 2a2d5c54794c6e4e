"""Fault scenarios: faults armed at points in the worker's code, an outage longer than the
lease, workers killed under quota pressure, and cancellation racing a reclaim. Each ends with
the invariant checker (runpool.invariants)."""

from __future__ import annotations

import os
import random
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

import runpool
from runpool.testing import Proxy, Watch, worker_pids
from tests.helpers import assert_invariants, events, run_row, running_pool, scalar, wait_for


@pytest.fixture
def proxy(server_dsn: str) -> Iterator[Proxy]:
    p = Proxy(server_dsn)
    yield p
    p.close()


def _armed(tmp_path: Path, spec: str) -> dict[str, str]:
    """Environment arming fault points once for the whole pool (restarts included)."""
    return {"RUNPOOL_FAULTS": spec, "RUNPOOL_FAULTS_DIR": str(tmp_path)}


def _all_ended(conn: psycopg.Connection, ids: list[uuid.UUID]) -> bool:
    return bool(scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                       " AND status IN ('succeeded', 'failed', 'cancelled')", ids) == len(ids))


def _tool_executions(conn: psycopg.Connection) -> int:
    return int(scalar(conn, "SELECT count(*) FROM tool_log"))


def _until(moment: float) -> None:
    """Wait for a moment on the monotonic clock (a scenario's schedule, not a synchronisation)."""
    wait_for(lambda: time.monotonic() >= moment, timeout=max(0.0, moment - time.monotonic()) + 5,
             what="the scheduled moment")


def test_connection_cut_during_claim__the_claim_rolls_back_and_nothing_is_lost(
        conn: psycopg.Connection, dsn: str, tmp_path: Path) -> None:
    ids = [runpool.enqueue(conn, "acme", "noop", {"i": i}) for i in range(20)]
    # Severed with the tenants locked and the claim statement not yet sent.
    with running_pool(dsn, env=_armed(tmp_path, "claim.locked=sever")) as pool:
        wait_for(lambda: _all_ended(conn, ids), timeout=30, what="every run")
        assert "action=fault_fired" in pool.log() and "action=claim_failed" in pool.log()
    # The cut claim rolled back: it cost no run an attempt.
    assert {run_row(conn, r)["attempt"] for r in ids} == {1}
    assert_invariants(conn)


def test_worker_killed_right_after_its_claim_committed__runs_reclaimed_after_the_lease(
        conn: psycopg.Connection, dsn: str, tmp_path: Path) -> None:
    ids = [runpool.enqueue(conn, "acme", "agent", {"steps": 2}) for _ in range(4)]
    with running_pool(dsn, lease_seconds=1.5,
                      env=_armed(tmp_path, "claim.committed=kill")) as pool:
        wait_for(lambda: _all_ended(conn, ids), timeout=40, what="every run")
        assert "action=worker_exited" in pool.log()
    # The claimed runs were never started, so no tool ran twice; they came back by expiry.
    assert max(run_row(conn, r)["attempt"] for r in ids) == 2
    assert _tool_executions(conn) == 8
    assert_invariants(conn)


def test_worker_killed_right_after_a_checkpoint_commit__resumes_at_the_next_call(
        conn: psycopg.Connection, dsn: str, tmp_path: Path) -> None:
    ids = [runpool.enqueue(conn, "acme", "agent", {"steps": 4}) for _ in range(3)]
    # One slot: the killed run is the only one in flight, so nothing else was mid-turn.
    with running_pool(dsn, concurrency=1, lease_seconds=1.5,
                      env=_armed(tmp_path, "checkpoint.committed=kill@3")):
        wait_for(lambda: _all_ended(conn, ids), timeout=40, what="every run")
    assert {run_row(conn, r)["status"] for r in ids} == {"succeeded"}
    assert any(run_row(conn, r)["attempt"] == 2 for r in ids)
    # Killed after commits only: every call and every model turn happened exactly once.
    assert _tool_executions(conn) == 12
    assert scalar(conn, "SELECT count(*) FROM model_calls") == 12
    assert_invariants(conn)


def test_outcome_write_cut__retried_and_each_run_ends_once(
        conn: psycopg.Connection, dsn: str, tmp_path: Path) -> None:
    ids = [runpool.enqueue(conn, "acme", "noop", {"i": i}) for i in range(10)]
    with running_pool(dsn, env=_armed(tmp_path, "outcome.committing=sever")) as pool:
        wait_for(lambda: _all_ended(conn, ids), timeout=30, what="every run")
        assert "action=fault_fired" in pool.log()
        assert "action=outcome_write_failed" in pool.log()  # the cut really hit the write
    assert {run_row(conn, r)["attempt"] for r in ids} == {1}
    assert_invariants(conn)


def test_outage_longer_than_the_lease__runs_resume_and_every_call_commits_once(
        conn: psycopg.Connection, dsn: str, proxy: Proxy) -> None:
    ids = [runpool.enqueue(conn, "acme", "agent", {"steps": 6, "tool_seconds": 0.3})
           for _ in range(4)]
    lease = 2.0
    with running_pool(proxy.dsn(dsn), lease_seconds=lease, poll_seconds=0.5) as pool:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.tool_calls"
                                " WHERE status = 'succeeded'") >= 4, what="progress")
        proxy.down()
        # The database is unreachable for 2.5 leases: every lease lapses meanwhile. Handlers
        # whose checkpoint writes fail end their attempt (to be retried); the others lose
        # their lease to the watchdog.
        _until(time.monotonic() + 2.5 * lease)
        wait_for(lambda: "action=heartbeat_failed" in pool.log(), what="heartbeats failing")
        proxy.up()
        wait_for(lambda: _all_ended(conn, ids), timeout=60, what="every run after the outage")
    assert {run_row(conn, r)["status"] for r in ids} == {"succeeded"}
    assert max(run_row(conn, r)["attempt"] for r in ids) >= 2
    assert_invariants(conn)


def test_quota_under_churn__never_exceeded_while_workers_are_killed_every_2s(
        conn: psycopg.Connection, dsn: str) -> None:
    for tenant in ("a", "b"):
        scalar(conn, "SELECT runpool.set_tenant_quota(%s, 3)", tenant)
    ids = [runpool.enqueue(conn, tenant, "agent", {"steps": 2, "tool_seconds": 0.1},
                           max_attempts=50)
           for _ in range(100) for tenant in ("a", "b")]
    rng = random.Random(7)
    with Watch(dsn) as watch, running_pool(dsn, workers=3, concurrency=4, lease_seconds=1.5,
                                           poll_seconds=0.5) as pool:
        kills = 0
        churn_ends = time.monotonic() + 30
        while time.monotonic() < churn_ends:
            pids = worker_pids(pool.pid)
            if pids:
                os.kill(rng.choice(pids), signal.SIGKILL)
                kills += 1
            _until(time.monotonic() + 2)
        wait_for(lambda: _all_ended(conn, ids), timeout=90, what="every run after the churn")
    assert kills >= 12 and watch.samples > 100
    assert {run_row(conn, r)["status"] for r in ids} == {"succeeded"}
    assert_invariants(conn, watch=watch)


def test_cancel_racing_a_reclaim__every_run_ends_cancelled_and_the_zombie_writes_nothing(
        conn: psycopg.Connection, dsn: str) -> None:
    ids = [runpool.enqueue(conn, "acme", "hold") for _ in range(8)]
    lease = 3.0
    settings: dict[str, Any] = {"lease_seconds": lease, "poll_seconds": 0.5,
                                "cancel_grace_seconds": 2}
    with running_pool(dsn, concurrency=8, **settings) as first:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                " WHERE status = 'running'") == 8, what="8 running")
        (pid,) = worker_pids(first.pid)
        os.kill(pid, signal.SIGSTOP)  # a zombie: holds 8 leases it no longer renews
        try:
            with running_pool(dsn, concurrency=8, **settings):
                # Each cancel lands at a different moment around its run's lease expiry: the
                # early ones find the worker dead, the late ones find the run reclaimed.
                expiries = {r: scalar(conn, "SELECT extract(epoch FROM lease_expires_at"
                                      " - now()) FROM runpool.runs WHERE id = %s", r)
                            for r in ids}
                start = time.monotonic()
                for i, run_id in enumerate(ids):
                    _until(start + float(expiries[run_id]) - 1.5 + i * 0.6)
                    scalar(conn, "SELECT runpool.cancel_run(%s, 'racing the reclaim')", run_id)
                wait_for(lambda: _all_ended(conn, ids), timeout=30, what="every run ended")
                os.kill(pid, signal.SIGCONT)
                wait_for(lambda: "action=lease_lost" in first.log(), what="zombie notices")
        finally:
            os.kill(pid, signal.SIGCONT)
    assert {run_row(conn, r)["status"] for r in ids} == {"cancelled"}
    histories = [events(conn, r) for r in ids]
    # Both orders happened: cancelled while the holder was dead, and cancelled once reclaimed.
    assert any("reclaimed" not in h for h in histories)
    assert any("reclaimed" in h for h in histories)
    # The zombie's cleanup after SIGCONT was fenced: attempt 1 wrote no message.
    assert scalar(conn, "SELECT count(*) FROM runpool.messages WHERE attempt = 1") == 0
    assert_invariants(conn, cancel_bound=lease + 0.5 + 2 + 3)
