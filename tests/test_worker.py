"""Real pools (`python -m runpool` subprocesses) against a real database."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from typing import Any

import psycopg

import runpool
from runpool.supervisor import GC_YOUNG_THRESHOLD
from tests.helpers import (
    assert_invariants,
    events,
    live_workers,
    pid_alive,
    run_row,
    running_pool,
    scalar,
    wait_for,
)


def _terminal(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    return run_row(conn, run_id)["status"] in ("succeeded", "failed", "cancelled")


def test_pool__runs_handlers_and_stores_results(conn: psycopg.Connection, dsn: str) -> None:
    ids = [runpool.enqueue(conn, "acme", "noop", {"i": i}) for i in range(20)]
    sync_id = runpool.enqueue(conn, "acme", "sync_sleep", {"seconds": 0.05})
    with running_pool(dsn, workers=2, concurrency=3):
        wait_for(lambda: all(_terminal(conn, i) for i in [*ids, sync_id]), what="runs done")
    for i, run_id in enumerate(ids):
        row = run_row(conn, run_id)
        assert (row["status"], row["result"]) == ("succeeded", {"input": {"i": i}, "attempt": 1})
        assert events(conn, run_id) == ["enqueued", "claimed", "succeeded"]
    assert run_row(conn, sync_id)["status"] == "succeeded"


def test_retry__backs_off_then_fails_after_max_attempts_and_retry_run_revives(
        conn: psycopg.Connection, dsn: str) -> None:
    flaky = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 2}, max_attempts=3)
    doomed = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 3}, max_attempts=3)
    with running_pool(dsn, retry_backoff_seconds=0.2, poll_seconds=30):
        wait_for(lambda: _terminal(conn, flaky) and _terminal(conn, doomed), what="retries")
        assert (run_row(conn, flaky)["status"], run_row(conn, flaky)["attempt"]) == (
            "succeeded", 3)
        failed = run_row(conn, doomed)
        assert (failed["status"], failed["attempt"], failed["error"]["reason"]) == (
            "failed", 3, "exception")
        assert "flaky failure on attempt 3" in failed["error"]["message"]
        assert events(conn, doomed) == ["enqueued", "claimed", "retry_scheduled", "claimed",
                                        "retry_scheduled", "claimed", "failed"]
        # Backoff is exponential: the second wait is longer than the first.
        waits = [w for (w,) in conn.execute(
            "SELECT extract(epoch FROM at - lag(at) OVER (ORDER BY id)) FROM runpool.run_events"
            " WHERE run_id = %s AND kind IN ('retry_scheduled', 'claimed') ORDER BY id",
            (doomed,))][2::2]
        assert waits[1] > waits[0] > 0.1
        # retry_run gives it a new budget; attempt 4 succeeds (fail_times=3).
        assert conn.execute("SELECT runpool.retry_run(%s)", (doomed,)).fetchone() == ("queued",)
        wait_for(lambda: run_row(conn, doomed)["status"] == "succeeded", what="revived run")
        assert run_row(conn, doomed)["attempt"] == 4
    assert_invariants(conn)


def test_bad_handlers__fail_once_with_a_reason_and_the_worker_keeps_going(
        conn: psycopg.Connection, dsn: str) -> None:
    # A handler no pool serves is not among them: its run waits (test_hardening_sql).
    cases = {
        "fails": "failed",
        "unserialisable": "result_not_serializable",
        "nul_result": "result_not_serializable",
    }
    ids = {runpool.enqueue(conn, "acme", h, max_attempts=5): r for h, r in cases.items()}
    with running_pool(dsn):
        wait_for(lambda: all(_terminal(conn, i) for i in ids), what="bad runs done")
        for run_id, reason in ids.items():
            row = run_row(conn, run_id)
            assert (row["status"], row["attempt"], row["error"]["reason"]) == (
                "failed", 1, reason), row
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, after)["status"] == "succeeded", what="worker alive")


def test_heartbeats__keep_a_long_run_through_many_lease_periods(
        conn: psycopg.Connection, dsn: str) -> None:
    # Four lease periods. A lease lasts from the beat that renewed it, and the next beat
    # goes a third of a lease later: a 2 s lease rides out a ~1.3 s stall of a loaded host,
    # where a 0.9 s one would lose it to a stall of ~0.6 s.
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 8})
    with running_pool(dsn, workers=2, lease_seconds=2):
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=30,
                 what="long run")
    row = run_row(conn, run_id)
    assert row["attempt"] == 1
    assert events(conn, run_id) == ["enqueued", "claimed", "succeeded"]
    assert_invariants(conn)


def test_worker_sigkilled_mid_run__run_completes_elsewhere_after_lease_expiry(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 2})
    with running_pool(dsn, workers=2, lease_seconds=1.5):
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="claim")
        holder = run_row(conn, run_id)["worker_id"]
        pid = scalar(conn, "SELECT pid FROM runpool.workers WHERE id = %s", holder)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=30,
                 what="reclaimed run to finish")
    row = run_row(conn, run_id)
    assert row["attempt"] == 2 and row["result"]["pid"] != pid
    assert events(conn, run_id) == ["enqueued", "claimed", "reclaimed", "claimed", "succeeded"]
    assert_invariants(conn)


def test_supervisor__restarts_a_killed_worker(conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, workers=1):
        (_, pid), = wait_for(lambda: live_workers(conn), what="worker up")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: [w for w in live_workers(conn) if w[1] != pid], what="restart")
        run_id = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="new worker works")


def test_sigterm__drains_finishes_short_runs_releases_long_ones(
        conn: psycopg.Connection, dsn: str) -> None:
    short = runpool.enqueue(conn, "acme", "sleep", {"seconds": 1})
    long = runpool.enqueue(conn, "acme", "sleep", {"seconds": 60})
    # Two slots, both busy: `late` could only start in a slot that frees during the drain.
    with running_pool(dsn, workers=1, concurrency=2, grace_seconds=2.5) as proc:
        wait_for(lambda: all(run_row(conn, i)["status"] == "running" for i in (short, long)),
                 what="both running")
        (_, worker_pid), = live_workers(conn)
        late = runpool.enqueue(conn, "acme", "noop", priority=100)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not pid_alive(worker_pid)
    assert run_row(conn, short)["status"] == "succeeded"
    released = run_row(conn, long)
    # Released at once for another host, and the attempt does not count against the budget.
    assert (released["status"], released["attempt"], released["attempt_offset"]) == (
        "queued", 1, 1)
    assert events(conn, long)[-1] == "released"
    # A draining pool claims nothing new.
    assert run_row(conn, late)["status"] == "queued"
    assert_invariants(conn, all_terminal=False)  # released and unclaimed runs stay queued


def test_second_sigterm__stops_at_once(conn: psycopg.Connection, dsn: str) -> None:
    long = runpool.enqueue(conn, "acme", "sleep", {"seconds": 60})
    with running_pool(dsn, workers=1, grace_seconds=60) as proc:
        wait_for(lambda: run_row(conn, long)["status"] == "running", what="running")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: "action=drain worker_id" in proc.log(), what="worker draining")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0
    assert run_row(conn, long)["status"] == "queued"
    assert events(conn, long)[-1] == "released"
    assert_invariants(conn, all_terminal=False)


def test_supervisor_sigkilled__workers_exit(conn: psycopg.Connection, dsn: str) -> None:
    with running_pool(dsn, workers=2) as proc:
        wait_for(lambda: len(live_workers(conn)) == 2, what="workers up")
        workers = live_workers(conn)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        wait_for(lambda: not any(pid_alive(pid) for _, pid in workers), timeout=15,
                 what="workers to exit")


def test_lease_taken_over__task_cancelled_and_its_outcome_fenced(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 3})
    with running_pool(dsn, workers=1, lease_seconds=1.2) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="claim")
        # Another claimer takes the run over (as after a reclaim): attempt 2 now holds it.
        conn.execute("UPDATE runpool.runs SET attempt = attempt + 1 WHERE id = %s", (run_id,))
        wait_for(lambda: "action=lease_lost" in pool.log(), what="lease loss noticed")
        # Attempt 2's lease runs out (nobody renews it), it is reclaimed, and attempt 3 runs.
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=30,
                 what="run finished by a later attempt")
    row = run_row(conn, run_id)
    assert row["attempt"] == 3 and row["result"]["attempt"] == 3
    # Attempt 1 never wrote its outcome, though its handler would have finished in 3 s.
    assert scalar(conn, "SELECT count(*) FROM runpool.run_events WHERE run_id = %s"
                  " AND kind = 'succeeded'", run_id) == 1
    assert_invariants(conn)


def test_forked_worker__its_collector_frozen_and_young_collections_rarer(
        conn: psycopg.Connection, dsn: str) -> None:
    # A full collection walked every long-lived object with the loop stopped (W11 2 x 1,000:
    # 83-110 ms each, several a minute); an embedded pool leaves the host's collector alone
    # (tests/test_embedding.py).
    run_id = runpool.enqueue(conn, "acme", "gc_state")
    with running_pool(dsn):
        wait_for(lambda: _terminal(conn, run_id), what="the run")
    result = scalar(conn, "SELECT result FROM runpool.runs WHERE id = %s", run_id)
    assert result["threshold"][0] == GC_YOUNG_THRESHOLD, result
    assert result["frozen"] > 10_000, result  # what the supervisor had imported


def test_idle_worker__its_heartbeat_costs_no_transaction(
        conn: psycopg.Connection, dsn: str) -> None:
    """W3 in small: an idle worker's heartbeat runs nothing (the serial-key heal sweep rides
    in the poll's claim transaction). With a heartbeat every 1/3 s and no poll due in the
    window, a sweep with a transaction of its own would touch a backend a dozen times in these
    4 s. Watched through pg_stat_activity, which is live: pg_stat_database's counts arrive
    late (an idle backend reports them up to 10 s on, later when the statistics' lock is
    contended), and a loaded CI run counted a slow startup's late transactions in the window."""
    quiet = ("SELECT coalesce(now() - max(state_change) > interval '2 s', false)"
             " FROM pg_stat_activity WHERE datname = current_database()"
             " AND pid <> pg_backend_pid()")
    touched = ("SELECT application_name, state, left(query, 200) FROM pg_stat_activity"
               " WHERE datname = current_database() AND pid <> pg_backend_pid()"
               " AND state_change > %s")
    with running_pool(dsn, lease_seconds=1.0, poll_seconds=30):
        wait_for(lambda: live_workers(conn), what="worker up")
        # Past startup (its first poll ran then; the next is due in 30 s): the worker's
        # backends have all been idle for 2 s.
        wait_for(lambda: scalar(conn, quiet), timeout=30,
                 what="the worker idle for 2 s (startup done, the heartbeat silent)")
        since = scalar(conn, "SELECT now()")
        time.sleep(4)  # the window watched: twelve heartbeats
        busy = conn.execute(touched, (since,)).fetchall()
    assert busy == [], busy


def test_heartbeat__a_row_held_through_beats_is_renewed_soon_after_it_is_let_go(
        conn: psycopg.Connection, dsn: str) -> None:
    # Another session share-locks the run's row (as a checkpoint batch's fence does) until the
    # lease has less than half a heartbeat interval left: every beat meanwhile finds it busy.
    # Let go, the row is renewed within the busy retry (0.5 s), not at the next interval
    # (3 s away: by then the lease would have run out and the run been reclaimed).
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 14})
    with running_pool(dsn, lease_seconds=9), psycopg.connect(dsn) as holder:
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="the run to start")
        holder.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR SHARE", (run_id,))
        wait_for(lambda: scalar(conn, "SELECT extract(epoch FROM lease_expires_at - now())"
                                      " FROM runpool.runs WHERE id = %s", run_id) < 1.5,
                 timeout=15, what="the lease to run low while its row is held")
        holder.rollback()
        wait_for(lambda: scalar(conn, "SELECT extract(epoch FROM lease_expires_at - now())"
                                      " FROM runpool.runs WHERE id = %s", run_id) > 3,
                 timeout=10, what="the lease renewed")
        wait_for(lambda: _terminal(conn, run_id), timeout=30, what="the run to end")
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"]) == ("succeeded", 1)


# Each write of a tool call holds its run's row a little longer (a slow commit's worth, as on
# a loaded machine): a trigger on the scratch database's tool_calls.
SLOW_TOOL_WRITES = """
CREATE FUNCTION public.slow_write() RETURNS trigger LANGUAGE plpgsql AS
$$ BEGIN PERFORM pg_sleep(0.02); RETURN NEW; END $$;
CREATE TRIGGER slow_write BEFORE INSERT OR UPDATE ON runpool.tool_calls
FOR EACH ROW EXECUTE FUNCTION public.slow_write();
"""


def test_heartbeat__a_run_writing_checkpoints_back_to_back_keeps_its_lease(
        conn: psycopg.Connection, dsn: str) -> None:
    # The heartbeat task runs only while the handler awaits, which is while its checkpoint
    # write is in flight and holds the run's row: a beat that skips locked rows found it busy
    # nearly every time, and the run lost its lease within a few lease periods (W8: 1,000
    # calls at a 2 s lease lost it on all three attempts). Here 4 lease periods of such
    # writes; the row is waited for, so the lease holds throughout.
    conn.execute(SLOW_TOOL_WRITES)
    run_id = runpool.enqueue(conn, "acme", "tool_burst", {"seconds": 8}, max_attempts=1)
    with running_pool(dsn, lease_seconds=2) as pool:
        wait_for(lambda: _terminal(conn, run_id), timeout=60, what="the run to end")
        log = pool.log()
    row = run_row(conn, run_id)
    assert (row["status"], row["attempt"]) == ("succeeded", 1), (row["error"], log[-3000:])
    assert row["result"]["calls"] > 20
    assert events(conn, run_id) == ["enqueued", "claimed", "succeeded"]
    assert "lease lost" not in log


def test_saturated_worker__claims_a_retry_when_its_backoff_ends_not_after_the_drain(
        conn: psycopg.Connection, dsn: str) -> None:
    # A saturated worker claims only on its outcome batches, which promote due runs at a
    # cadence rather than in every batch: a retry's backoff still ends within the drain.
    flaky = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 1}, priority=100)
    crowd = runpool.enqueue_many(conn, [runpool.RunSpec("acme", "noop") for _ in range(1500)])
    with running_pool(dsn, concurrency=2, retry_backoff_seconds=0.2, poll_seconds=30):
        wait_for(lambda: _terminal(conn, flaky), what="the flaky run's retry")
        assert run_row(conn, flaky)["status"] == "succeeded"
        left = scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                      " AND status = 'queued'", crowd)
        assert left > 0, "the retry waited for the whole crowd: the backoff's end was missed"


def test_worker_processes__run_on_uvloop_unless_turned_off() -> None:
    # uvloop is a dependency (W1: ~8 % less worker CPU per run): the default loop of a worker
    # process and of the host's listener process, RUNPOOL_UVLOOP=0 turns it off.
    import uvloop

    from runpool.settings import Settings
    from runpool.supervisor import _loop_factory

    assert _loop_factory(Settings()) is uvloop.new_event_loop
    assert _loop_factory(Settings(uvloop=False)) is None


def test_pool_stopped_as_it_starts__leaves_no_task_behind(dsn: str) -> None:
    """Stopped at once, the worker cancels its heartbeat while that opens its own pool: the
    half-open pool's maintenance tasks were left running, and asyncio.run's shutdown waited on
    them now and then for good (a CI run of test_schedules hung 180 s)."""
    async def main() -> list[asyncio.Task[Any]]:
        for _ in range(3):
            async with runpool.Pool(runpool.App(), dsn=dsn):
                pass
        return [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]

    assert asyncio.run(main()) == []
