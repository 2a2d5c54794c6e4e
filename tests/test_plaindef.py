"""Plain-def handlers and plain-def tools run in threads, which cannot be stopped (issue 21).

A run whose thread still runs is never released, recorded ended or reclaimed, and keeps its
slot: drain, cancellation and lease loss with real pools; every step a thread really executes
is logged with the database clock (plain_log), and executions must never overlap.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import subprocess
import sys
import uuid
from datetime import datetime
from typing import Any

import psycopg
import pytest

import runpool
from tests.helpers import (
    ROOT,
    assert_invariants,
    pool_env,
    run_row,
    running_pool,
    scalar,
    status_of,
    wait_for,
)

CANCEL = "SELECT runpool.cancel_run(%s, %s)"
PLAIN_LOG_DDL = """
CREATE TABLE plain_log (
    run_id uuid NOT NULL, attempt integer NOT NULL, pid integer NOT NULL, what text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
# One interval per execution (attempt, process) of a run: its first and last logged step.
EXECUTIONS = """
SELECT attempt, pid, min(at), max(at), count(*) FROM plain_log WHERE run_id = %s
GROUP BY attempt, pid ORDER BY min(at)"""


@pytest.fixture(autouse=True)
def plain_log(conn: psycopg.Connection) -> None:
    conn.execute(PLAIN_LOG_DDL)


def executions(conn: psycopg.Connection, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    return list(conn.execute(EXECUTIONS, (run_id,)))


def assert_no_overlap(conn: psycopg.Connection, run_id: uuid.UUID) -> list[tuple[Any, ...]]:
    """Each execution of the run ended (its last step) before the next one began."""
    runs = executions(conn, run_id)
    for before, after in itertools.pairwise(runs):
        assert before[3] < after[2], f"two executions of {run_id} overlap: {before} / {after}"
    return runs


def last_step(conn: psycopg.Connection, run_id: uuid.UUID) -> datetime:
    return scalar(conn, "SELECT max(at) FROM plain_log WHERE run_id = %s", run_id)  # type: ignore[no-any-return]


def steps(conn: psycopg.Connection, run_id: uuid.UUID) -> int:
    return int(scalar(conn, "SELECT count(*) FROM plain_log WHERE run_id = %s", run_id))


def claimed_at(conn: psycopg.Connection, run_id: uuid.UUID) -> datetime:
    return scalar(conn, "SELECT min(at) FROM runpool.run_events WHERE run_id = %s"  # type: ignore[no-any-return]
                  " AND kind = 'claimed'", run_id)


# -- drain -----------------------------------------------------------------------------------

@pytest.mark.parametrize("writes", [False, True], ids=["ignores", "writes"])
def test_drain__a_plain_run_never_executes_in_two_pools_at_once(
        conn: psycopg.Connection, dsn: str, writes: bool) -> None:
    """Drained past its grace: a handler that makes no runpool call keeps its run (the worker
    exits, the thread with it, the lease expires); one that writes is refused at its next
    add_message_sync, its thread ends, and only then is the run released. Meanwhile a second
    pool waits to take the run over."""
    # 300 steps (30 s and more): far longer than the drain takes to end the first pool's
    # worker (grace 1 s, the cancelled task's 5 s, the exit), also under load (CI: 60 steps
    # all ran before the worker exited).
    run_id = runpool.enqueue(conn, "acme", "plain_steps", {
        "steps": 300, "step": 0.1, "later_steps": 3, "writes": writes})
    with running_pool(dsn, grace_seconds=1, lease_seconds=3, concurrency=2) as first:
        wait_for(lambda: steps(conn, run_id) >= 3, what="the first pool's thread to run")
        with running_pool(dsn, grace_seconds=1, lease_seconds=3, poll_seconds=0.5) as second:
            first.send_signal(signal.SIGTERM)
            first.wait(timeout=20)
            wait_for(lambda: status_of(conn, run_id) == "succeeded", timeout=30,
                     what="the second pool to finish the run")
            log = first.log()
            assert second.poll() is None
    runs = assert_no_overlap(conn, run_id)
    assert [r[0] for r in runs] == [1, 2], runs
    assert runs[0][1] != runs[1][1], "the second attempt ran in the other pool"
    assert runs[0][4] < 300, "the drain did end the first execution"
    if writes:
        assert "thread_stuck" not in log and "released 1 runs" in log, log[-3000:]
        released = scalar(conn, "SELECT at FROM runpool.run_events WHERE run_id = %s"
                          " AND kind = 'released'", run_id)
        assert released > runs[0][3], "released only after the thread's last step"
    else:
        assert "thread_stuck" in log and "released 1 runs" not in log, log[-3000:]
    assert_invariants(conn)


# -- cancellation ----------------------------------------------------------------------------

def test_cancel__a_plain_handler_sees_it_and_its_cleanup_is_committed_before_the_record(
        conn: psycopg.Connection, dsn: str) -> None:
    """Also: the run keeps counting against its tenant's quota (1) until it is recorded."""
    run_id = runpool.enqueue(conn, "acme", "plain_steps", {
        "steps": 600, "step": 0.05, "honour": True, "cleanup_seconds": 0.5})
    with running_pool(dsn, concurrency=2, tenant_quota=1, cancel_grace_seconds=5) as pool:
        wait_for(lambda: steps(conn, run_id) >= 2, what="the thread to run")
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: status_of(conn, run_id) == "cancelled", timeout=10, what="cancelled")
        wait_for(lambda: status_of(conn, after) == "succeeded", what="the next run")
        assert "thread_stuck" not in pool.log()
    row = run_row(conn, run_id)
    cleanup = list(conn.execute(
        "SELECT content, created_at FROM runpool.messages WHERE run_id = %s", (run_id,)))
    assert [c for c, _ in cleanup] == [{"cleanup": True, "step": cleanup[0][0]["step"]}]
    cleaned_up = scalar(conn, "SELECT at FROM plain_log WHERE run_id = %s"
                        " AND what = 'cleaned up'", run_id)
    # Recorded only once the handler returned; the tenant's next run waited for its quota.
    assert row["finished_at"] > cleaned_up
    assert claimed_at(conn, after) > cleaned_up
    assert row["error"]["reason"] == "cancelled"
    assert_invariants(conn, cancel_bound=15)


def test_cancel__a_plain_handler_ignoring_it_past_the_grace_ends_with_its_worker(
        conn: psycopg.Connection, dsn: str) -> None:
    """The thread cannot be stopped: the worker stops claiming, exits (code 75) and is
    restarted; the run is recorded cancelled when its lease expires. Until the thread is gone
    the slot stays taken: the next run starts only after the thread's last step."""
    run_id = runpool.enqueue(conn, "acme", "plain_steps", {"steps": 600, "step": 0.1})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=1, grace_seconds=1,
                      lease_seconds=3, poll_seconds=0.5) as pool:
        wait_for(lambda: steps(conn, run_id) >= 2, what="the thread to run")
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: status_of(conn, after) == "succeeded", timeout=30, what="the next run")
        wait_for(lambda: status_of(conn, run_id) == "cancelled", timeout=10,
                 what="the reaper to record the cancel")
        log = pool.log()
    assert "thread_stuck" in log and "exited to end a handler thread" in log, log[-3000:]
    last = last_step(conn, run_id)
    assert claimed_at(conn, after) > last
    assert run_row(conn, run_id)["finished_at"] > last
    assert_invariants(conn, cancel_bound=30)


# -- lease loss ------------------------------------------------------------------------------

@pytest.mark.parametrize("writes", [False, True], ids=["ignores", "writes"])
def test_lease_loss__the_slot_stays_taken_until_the_thread_is_gone(
        conn: psycopg.Connection, dsn: str, writes: bool) -> None:
    """The lease is taken away (expired in the database): the heartbeat finds it gone. The
    thread goes on, so the run is not reclaimed by this worker (concurrency 1) before the
    thread is gone: a handler that writes gets LeaseLost and returns; one that ignores
    everything ends with its worker. Attempt 2 starts after attempt 1's last step."""
    run_id = runpool.enqueue(conn, "acme", "plain_steps", {
        "steps": 600, "step": 0.1, "later_steps": 3, "writes": writes})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=1, grace_seconds=1,
                      lease_seconds=3, poll_seconds=0.5) as pool:
        wait_for(lambda: steps(conn, run_id) >= 2, what="the thread to run")
        conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 second'"
                     " WHERE id = %s", (run_id,))
        wait_for(lambda: status_of(conn, run_id) == "succeeded", timeout=30,
                 what="attempt 2 to finish")
        log = pool.log()
    assert "lease_lost" in log and ("thread_stuck" in log) is not writes, log[-3000:]
    runs = assert_no_overlap(conn, run_id)
    assert [r[0] for r in runs] == [1, 2], runs
    assert_invariants(conn)


# -- a plain tool inside an async handler ----------------------------------------------------

def test_cancel__a_plain_tool_in_an_async_handler_is_waited_for(
        conn: psycopg.Connection, dsn: str) -> None:
    """The handler's task is cancelled at once; the tool's thread is not. The run is recorded
    cancelled and its slot reused only after the tool's thread returned."""
    run_id = runpool.enqueue(conn, "acme", "plain_tool", {"steps": 20})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=5):
        wait_for(lambda: steps(conn, run_id) >= 2, what="the tool's thread to run")
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: status_of(conn, after) == "succeeded", timeout=15, what="the next run")
    assert steps(conn, run_id) == 20, "the tool ran to its end"
    last = last_step(conn, run_id)
    assert status_of(conn, run_id) == "cancelled"
    assert run_row(conn, run_id)["finished_at"] > last
    assert claimed_at(conn, after) > last
    assert_invariants(conn, cancel_bound=15)


# -- misuse ----------------------------------------------------------------------------------

def test_sync_methods_called_on_the_event_loop__a_clear_error_not_a_hung_worker() -> None:
    """add_message_sync in an async handler would block the loop on itself forever."""
    async def main() -> None:
        run = runpool.Run(id=uuid.uuid4(), tenant="acme", handler="h", attempt=1, input=None)
        with pytest.raises(RuntimeError, match="plain `def` handlers"):
            run.add_message_sync("assistant", "hello")
        with pytest.raises(RuntimeError, match="plain `def` handlers"):
            run.tool_sync("c0", "t", {}, lambda arguments, key: None)

    asyncio.run(main())


def test_lease_loss__a_stuck_thread_makes_its_worker_exit_without_waiting_for_the_grace(
        conn: psycopg.Connection, dsn: str) -> None:
    """Its run may already run elsewhere: the worker releases its other runs and exits after
    the cancel grace, not after a 30 s drain; the other run is resumed at once."""
    stuck = runpool.enqueue(conn, "acme", "plain_steps", {
        "steps": 600, "step": 0.1, "later_steps": 1})
    other = runpool.enqueue(conn, "acme", "sleep", {"seconds": 3})
    with running_pool(dsn, concurrency=2, cancel_grace_seconds=1, grace_seconds=30,
                      lease_seconds=3, poll_seconds=0.5) as pool:
        wait_for(lambda: steps(conn, stuck) >= 2 and status_of(conn, other) == "running",
                 what="both runs to start")
        conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 second'"
                     " WHERE id = %s", (stuck,))
        wait_for(lambda: "exited to end a handler thread" in pool.log(), timeout=12,
                 what="the worker to exit")
        wait_for(lambda: status_of(conn, stuck) == status_of(conn, other) == "succeeded",
                 timeout=30, what="both runs to finish")
        assert "released 1 runs" in pool.log()
    assert_no_overlap(conn, stuck)
    assert_invariants(conn)


# -- embedded ------------------------------------------------------------------------------

EMBEDDED_HOST = """
import asyncio, sys, time
import runpool

app = runpool.App()

@app.handler("stuck")
def stuck(run):
    time.sleep(120)  # ignores everything

async def main():
    pool = runpool.Pool(app, dsn=sys.argv[1], concurrency=1, cancel_grace_seconds=0.5,
                        grace_seconds=0.5, lease_seconds=3, poll_seconds=0.2)
    await pool.start()
    print("started", flush=True)
    try:
        await pool.wait()
    except runpool.WorkerFailed:
        print("worker failed", pool.exit_code, flush=True)

asyncio.run(main())
print("host exiting", flush=True)
"""


def test_embedded__a_stuck_thread_does_not_hold_the_host_process_at_exit(
        conn: psycopg.Connection, dsn: str) -> None:
    """Pool.wait() raises WorkerFailed (exit code 75 for the host); the host's interpreter then
    exits at once: the stuck thread ends with the process instead of being joined."""
    run_id = runpool.enqueue(conn, "acme", "stuck")
    host = subprocess.Popen([sys.executable, "-c", EMBEDDED_HOST, dsn], env=pool_env(dsn),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        wait_for(lambda: status_of(conn, run_id) == "running", what="the run to start")
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        out, _ = host.communicate(timeout=30)
    finally:
        if host.poll() is None:
            os.killpg(host.pid, signal.SIGKILL)
            host.wait()
    assert "worker failed 75" in out and "host exiting" in out, out[-3000:]
    assert host.returncode == 0, out[-3000:]
    # Its lease expires; a pool that knows nothing of the thread records the cancel.
    with running_pool(dsn, poll_seconds=0.5):
        wait_for(lambda: status_of(conn, run_id) == "cancelled", what="cancelled")
