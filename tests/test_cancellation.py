"""Cancellation over NOTIFY with the heartbeat as fallback; races; least-privilege roles."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import runpool
from runpool.claiming import claim
from runpool.db import aconnect, connect
from runpool.queries import QUERIES
from runpool.testing.proxy import Proxy
from runpool.trips import HOT_STATEMENTS
from tests.helpers import (
    assert_invariants,
    events,
    finish_params,
    live_workers,
    run_row,
    running_pool,
    scalar,
    wait_for,
)

CANCEL = "SELECT runpool.cancel_run(%s, %s)"
# Is a LISTEN connection up?
LISTENERS = ("SELECT count(*) > 0 FROM pg_stat_activity WHERE datname = current_database()"
             " AND query LIKE 'LISTEN runpool_wakeup%%'")


def _running(conn: psycopg.Connection, run_id: uuid.UUID) -> bool:
    return bool(run_row(conn, run_id)["status"] == "running")


def _status(conn: psycopg.Connection, run_id: uuid.UUID) -> str:
    return str(run_row(conn, run_id)["status"])


def test_cancel_async_run__interrupted_at_its_next_await_and_cleans_up(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "hold")
    with running_pool(dsn, poll_seconds=60):
        wait_for(lambda: _running(conn, run_id), what="running")
        assert scalar(conn, CANCEL, run_id, "user pressed stop") == "cancelling"
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=5, what="cancelled")
        after = runpool.enqueue(conn, "acme", "noop")  # the slot is free again
        wait_for(lambda: _status(conn, after) == "succeeded", what="next run")
    row = run_row(conn, run_id)
    assert (row["cancel_reason"], row["error"]["reason"]) == ("user pressed stop", "cancelled")
    cleanup = scalar(conn, "SELECT content FROM runpool.messages WHERE run_id = %s", run_id)
    assert cleanup["cancelled"] is True
    assert events(conn, run_id) == ["enqueued", "claimed", "cancel_requested", "cancelled"]
    assert scalar(conn, CANCEL, run_id, "again") == "cancelled"
    assert_invariants(conn, cancel_bound=15)


def test_cancel_sync_run__no_new_tool_call_starts_after_the_cancel(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "hold_sync")
    with running_pool(dsn):
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.tool_calls"
                                " WHERE run_id = %s", run_id) >= 3, what="tool calls")
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=5, what="cancelled")
        finished_at = run_row(conn, run_id)["finished_at"]
        calls = scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s", run_id)
        # Let the handler's thread go on for a while (it would start calls every 0.1 s).
        later = runpool.enqueue(conn, "acme", "sleep", {"seconds": 0.5})
        wait_for(lambda: _status(conn, later) == "succeeded", what="time to pass")
    assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s",
                  run_id) == calls
    assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                  " AND started_at > %s", run_id, finished_at) == 0
    # The call in flight at the cancel was either committed or left interrupted, never both.
    assert scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                  " AND status = 'started'", run_id) <= 1
    assert_invariants(conn, cancel_bound=15)


def test_handler_ignoring_cancellation__recorded_cancelled_after_the_grace(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "stubborn")
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=0.5):
        wait_for(lambda: _running(conn, run_id), what="running")
        scalar(conn, CANCEL, run_id, "stop")
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=10, what="forced")
        # The only slot is free again although the handler never returned.
        nxt = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: _status(conn, nxt) == "succeeded", what="slot freed")
    assert_invariants(conn)


def test_handler_returning_after_its_forced_cancel__its_slot_is_freed_once(
        conn: psycopg.Connection, dsn: str) -> None:
    # One slot. The handler ignores its cancel past the grace (recorded cancelled, the slot
    # freed, taken by `held`) and returns later while `queued` waits: its late outcome must not
    # free the slot a second time (its refill would claim `queued`: two runs in one slot).
    run_id = runpool.enqueue(conn, "acme", "late", {"seconds": 1.5})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=0.3, poll_seconds=60) as pool:
        wait_for(lambda: _running(conn, run_id), what="running")
        scalar(conn, CANCEL, run_id, "stop")
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=10, what="forced")
        held = runpool.enqueue(conn, "acme", "hold")
        wait_for(lambda: _running(conn, held), what="the freed slot taken")
        queued = runpool.enqueue(conn, "acme", "noop")
        # (Dropped now; written, it would log once its trip, refill and all, committed.)
        wait_for(lambda: any(f"action={a}" in pool.log() for a in (
            "late_outcome_dropped", "outcome_not_recorded")), timeout=10,
            what="the handler's late return")
        assert _status(conn, queued) == "queued"
        assert scalar(conn, CANCEL, held, "done") == "cancelling"
        wait_for(lambda: _status(conn, queued) == "succeeded", what="the slot's next run")
    assert events(conn, run_id) == ["enqueued", "claimed", "cancel_requested", "cancelled"]
    assert_invariants(conn, cancel_bound=15)


@contextlib.contextmanager
def _forced_end_held(conn: psycopg.Connection, dsn: str, run_id: uuid.UUID) -> Iterator[None]:
    """Cancel a running `late` run (`noted`, so it has an event counter row) with its forced
    end's write held in flight, by a lock on that row (the write's counter bump waits for it),
    until the block ends."""
    wait_for(lambda: _running(conn, run_id) and scalar(
        conn, "SELECT count(*) FROM runpool.event_seqs WHERE run_id = %s", run_id),
        what="running, with its counter row")
    with psycopg.connect(dsn) as locker:
        scalar(conn, CANCEL, run_id, "stop")
        locker.execute("SELECT 1 FROM runpool.event_seqs WHERE run_id = %s FOR UPDATE",
                       (run_id,))
        yield
        locker.rollback()


def _handler_returned(pool: Any) -> None:
    wait_for(lambda: "action=late_handler_returns" in pool.log(), timeout=10,
             what="the handler's return, its forced end in flight")


def test_handler_returning_while_its_forced_end_is_written__the_slot_waits_for_the_write(
        conn: psycopg.Connection, dsn: str) -> None:
    # One slot. The forced end's write is held in flight (the test locks the run's event
    # counter row, which the write's counter bump waits for) while the handler returns. Its
    # late outcome must not be written, nor its task's end free the slot before the forced
    # write is done: either let a claim start a second run in the one slot.
    run_id = runpool.enqueue(conn, "acme", "late", {"seconds": 1.5, "noted": True})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=1.0, poll_seconds=60) as pool:
        wait_for(lambda: _running(conn, run_id), what="running")
        holds = [runpool.enqueue(conn, "acme", "hold") for _ in range(3)]
        with _forced_end_held(conn, dsn, run_id):
            _handler_returned(pool)
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=10, what="forced")
        # (Written, a late outcome would log once its trip, refill and all, committed.)
        wait_for(lambda: any(f"action={a}" in pool.log() for a in (
            "late_outcome_dropped", "outcome_not_recorded", "run_finished")), timeout=10,
            what="the late outcome's fate")
        wait_for(lambda: any(_running(conn, h) for h in holds), what="the slot's next run")
        assert sum(_running(conn, h) for h in holds) == 1
    assert events(conn, run_id)[-1] == "cancelled"


def test_drain__waits_for_a_forced_end_being_written(conn: psycopg.Connection, dsn: str) -> None:
    # The worker is told to stop while the forced end of a run is being written (held in
    # flight by a lock on the run's event counter row) and its handler has returned: the
    # drain waits for that write, so the run ends as its cancel asked, not at its lease's
    # expiry (which would cost a worker's reap and say 'lease_expired').
    run_id = runpool.enqueue(conn, "acme", "late", {"seconds": 1.5, "noted": True})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=1.0, poll_seconds=60,
                      stop="drain") as pool:
        with _forced_end_held(conn, dsn, run_id):
            _handler_returned(pool)
            pool.send_signal(signal.SIGTERM)
            wait_for(lambda: "action=drain worker_id" in pool.log(), timeout=10,
                     what="the worker's drain begun")
        assert pool.wait(timeout=30) == 0
    row = run_row(conn, run_id)
    assert row["status"] == "cancelled"  # (without the wait: still 'running', its write lost)
    assert (row["error"]["reason"], row["cancel_reason"]) == ("cancelled", "stop")


def test_drain__waits_for_a_forced_end_that_begins_during_it(
        conn: psycopg.Connection, dsn: str) -> None:
    # The worker is told to stop inside the run's cancel grace: its forced end's write begins
    # after the drain did (held in flight by the lock), and the handler returns half a second
    # later. The drain looks again at what it waits for: the write, within its 60 s grace.
    # (It used to give the write only the last 5 s of a drain, once the handler had returned.)
    run_id = runpool.enqueue(conn, "acme", "late", {"seconds": 1.5, "noted": True})
    with running_pool(dsn, concurrency=1, cancel_grace_seconds=1.0, poll_seconds=60,
                      grace_seconds=60, stop="drain") as pool:
        with _forced_end_held(conn, dsn, run_id):
            pool.send_signal(signal.SIGTERM)
            _handler_returned(pool)
            # The window the old drain gave the write, and a second more: it must still wait.
            with pytest.raises(subprocess.TimeoutExpired):
                pool.wait(timeout=6)
        assert pool.wait(timeout=30) == 0
    row = run_row(conn, run_id)
    assert (row["status"], row["cancel_reason"]) == ("cancelled", "stop")


@pytest.mark.parametrize("how", ["listen_off", "listener_killed"])
def test_cancel_without_notify__arrives_through_the_heartbeat(
        conn: psycopg.Connection, dsn: str, how: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "hold")
    settings: dict[str, Any] = {"lease_seconds": 1.5, "poll_seconds": 60}
    if how == "listen_off":
        settings["listen"] = 0
    with running_pool(dsn, **settings):
        wait_for(lambda: _running(conn, run_id), what="running")
        if how == "listener_killed":
            scalar(conn, "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                   " WHERE datname = current_database() AND query LIKE 'LISTEN%%'")
        scalar(conn, CANCEL, run_id, "stop")
        # Heartbeat every 0.5 s: well within one interval plus a second.
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=3, what="cancelled")
    assert_invariants(conn, cancel_bound=15)


@pytest.mark.parametrize("workers", [1, 2], ids=["own_listener", "host_relay"])
def test_cancel_sent_while_no_one_listens__read_from_the_flag_on_reconnect(
        conn: psycopg.Connection, dsn: str, server_dsn: str, workers: int) -> None:
    # The LISTEN connection (the worker's own, or the host relay's) is cut and cannot
    # reconnect, while the claim's connection works: a run starts by a poll, and its cancel
    # is requested while no one listens. A 90 s lease beats every 30 s: only the catch-up once
    # the LISTEN is back can end the run within the wait below.
    proxy = Proxy(server_dsn)
    try:
        with running_pool(dsn, workers=workers, lease_seconds=90, poll_seconds=0.5,
                          listen_dsn=proxy.dsn(dsn)) as pool:
            # The workers too are up: each checks the LISTEN's server once at its start.
            wait_for(lambda: scalar(conn, LISTENERS) and len(live_workers(conn)) == workers,
                     what="listening, with every worker up")
            proxy.down()
            wait_for(lambda: "action=listen_connect_failed" in pool.log(),
                     what="the LISTEN refused")
            run_id = runpool.enqueue(conn, "acme", "hold")
            wait_for(lambda: _running(conn, run_id), what="running")
            assert scalar(conn, CANCEL, run_id, "no one listened") == "cancelling"
            proxy.up()
            wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=15,
                     what="cancelled once listening again")
    finally:
        proxy.close()
    assert run_row(conn, run_id)["cancel_reason"] == "no one listened"
    assert_invariants(conn, cancel_bound=15)


def test_cancel_during_a_database_outage__read_once_listening_again(
        conn: psycopg.Connection, dsn: str, server_dsn: str) -> None:
    # Every connection of the worker goes through the proxy, which resets and refuses them
    # all for a moment (a restart, a failover, a network cut) while the run's cancel is
    # requested. The catch-up read follows the LISTEN's reconnect, when the pool's
    # connections are dead too: it must read again on a fresh one, not leave the cancel to
    # the heartbeat (every 30 s with this lease).
    proxy = Proxy(server_dsn)
    try:
        with running_pool(proxy.dsn(dsn), workers=1, lease_seconds=90, poll_seconds=0.5,
                          pool_size=4) as pool:
            run_id = runpool.enqueue(conn, "acme", "hold")
            wait_for(lambda: _running(conn, run_id) and scalar(conn, LISTENERS),
                     what="running, and listening")
            proxy.down()
            assert scalar(conn, CANCEL, run_id, "outage") == "cancelling"
            wait_for(lambda: "action=listen_lost" in pool.log(), what="the LISTEN lost")
            proxy.up()
            wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=15,
                     what="cancelled once listening again")
    finally:
        proxy.close()
    assert_invariants(conn, cancel_bound=15)


def test_cancel_while_the_worker_is_dead__ends_cancelled_not_reclaimed(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "hold")
    with running_pool(dsn, workers=2, lease_seconds=1.5):
        wait_for(lambda: _running(conn, run_id), what="running")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", run_id)
        os.kill(pid, signal.SIGKILL)
        assert scalar(conn, CANCEL, run_id, "stop") == "cancelling"
        wait_for(lambda: _status(conn, run_id) == "cancelled", timeout=15, what="cancelled")
    assert run_row(conn, run_id)["attempt"] == 1
    assert "claimed" not in events(conn, run_id)[2:]
    assert_invariants(conn, cancel_bound=15)


def test_forged_notify__changes_nothing(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "hold", {"seconds": 1.5})
    with running_pool(dsn) as pool:
        # Listening: a notice sent before would be lost, and the test would check nothing.
        wait_for(lambda: _running(conn, run_id) and scalar(conn, LISTENERS),
                 what="running, and listening")
        conn.execute("SELECT pg_notify('runpool_cancel', %s)", (str(run_id),))
        conn.execute("SELECT pg_notify('runpool_cancel', 'not a uuid; DROP TABLE x')")
        wait_for(lambda: _status(conn, run_id) == "succeeded", what="run unaffected")
        assert "cancel_notice_ignored" in pool.log()
    assert run_row(conn, run_id)["result"] == "not cancelled"


# -- races, forced with open transactions ---------------------------------------------------

def _cancel_in_thread(dsn: str, run_id: uuid.UUID, reason: str,
                     answers: list[Any]) -> threading.Thread:
    """cancel_run on its own connection, in a thread: it may block behind a row lock."""
    def cancel() -> None:
        with connect(dsn, autocommit=True) as c:
            answers.append(scalar(c, CANCEL, run_id, reason))

    thread = threading.Thread(target=cancel)
    thread.start()
    return thread


def _blocked(conn: psycopg.Connection) -> bool:
    return bool(scalar(conn, "SELECT count(*) FROM pg_locks WHERE NOT granted"))


def test_race_cancel_during_claim__claim_first_then_cancel_says_cancelling(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    answers: list[Any] = []
    with connect(dsn) as claimer:  # one open claim transaction, committed by hand
        claimer.execute(QUERIES["lock_tenants"], {"handlers": ["noop"], "limit": 1,
                                                    "roomy": False})
        claimer.execute(QUERIES["claim_runs"], {"limit": 1,
                                                "handlers": ["noop"], "worker_id": uuid.uuid4(),
                                                "lease_seconds": 30})
        canceller = _cancel_in_thread(dsn, run_id, "race", answers)
        wait_for(lambda: _blocked(conn), what="cancel blocked behind the claim")
        claimer.commit()
        canceller.join(10)
    assert answers == ["cancelling"]
    row = run_row(conn, run_id)
    assert (row["status"], row["cancel_reason"]) == ("running", "race")


def test_race_cancel_during_claim__cancel_first_the_claim_skips_it(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    with connect(dsn) as canceller:
        assert scalar(canceller, CANCEL, run_id, "race") == "cancelled"  # not committed yet

        async def main() -> list[Any]:
            async with await aconnect(dsn, autocommit=True) as c:
                return await claim(c, worker_id=uuid.uuid4(), limit=5, lease_seconds=30)

        assert asyncio.run(main()) == []  # skipped, not waited for
        canceller.commit()
    assert _status(conn, run_id) == "cancelled"


def test_race_cancel_during_final_commit__cancel_reports_what_won(
        conn: psycopg.Connection, dsn: str) -> None:
    first = runpool.enqueue(conn, "acme", "noop")
    second = runpool.enqueue(conn, "acme", "noop")
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                 " lease_expires_at = now() + interval '1 minute'")
    # The commit wins: the cancel, blocked behind it, reports the truth.
    answers: list[Any] = []
    with connect(dsn) as worker:
        worker.execute(QUERIES["finish_runs"], finish_params([(first, 1)]))
        canceller = _cancel_in_thread(dsn, first, "late", answers)
        wait_for(lambda: _blocked(conn), what="cancel blocked behind the commit")
        worker.commit()
        canceller.join(10)
    assert answers == ["succeeded"] and _status(conn, first) == "succeeded"
    # The cancel wins the row first: it says 'cancelling'; a handler that still finishes its
    # work ends succeeded, and a repeated cancel says so.
    assert scalar(conn, CANCEL, second, "early") == "cancelling"
    conn.execute(QUERIES["finish_runs"], finish_params([(second, 1)]))
    assert scalar(conn, CANCEL, second, "again") == "succeeded"


# -- roles ----------------------------------------------------------------------------------

def test_api_role__may_only_call_the_api_and_read(conn: psycopg.Connection) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("SET ROLE runpool_api")
    try:
        new = scalar(conn, "SELECT runpool.enqueue('acme', 'noop')")
        assert scalar(conn, "SELECT runpool.explain_run(%s)", new)["status"] == "queued"
        assert scalar(conn, CANCEL, new, "api") == "cancelled"
        assert scalar(conn, "SELECT runpool.retry_run(%s)", new) == "queued"
        assert scalar(conn, "SELECT count(*) FROM runpool.runs") == 2
        forbidden = [
            "UPDATE runpool.runs SET status = 'succeeded'",
            "DELETE FROM runpool.runs",
            "INSERT INTO runpool.tenants (tenant) VALUES ('x')",
            "UPDATE runpool.config SET default_quota = 1",
            "SELECT runpool.set_tenant_quota('acme', 100)",
        ]
        for statement in forbidden:
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute(statement)
    finally:
        conn.execute("RESET ROLE")
    assert _status(conn, run_id) == "queued"


def test_catalog__every_function_is_definer_pinned_and_not_public(
        conn: psycopg.Connection) -> None:
    # 0008's rule functions are pure expressions the planner inlines (tests/test_rules.py):
    # a definer or a SET would stop that, and they act with no rights of their own. Their
    # SQL-standard bodies bind every name when created; like every function, no PUBLIC.
    rows = conn.execute("""
        SELECT p.proname, p.prosecdef, coalesce(array_to_string(p.proconfig, ','), ''),
               EXISTS (SELECT 1 FROM aclexplode(coalesce(p.proacl, acldefault('f', p.proowner)))
                       a WHERE a.grantee = 0 AND a.privilege_type = 'EXECUTE'),
               p.prosqlbody IS NOT NULL AND p.provolatile <> 'v' AND NOT p.prosecdef
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname = 'runpool'""").fetchall()
    assert {r[0] for r in rows} >= {"enqueue", "cancel_run", "retry_run", "set_tenant_quota",
                                    "explain_run"}
    # epoch_us (0021, a run id's time) is such an expression too, and so are 0022's timeout
    # rule and its seconds-to-interval step (enqueue's and enqueue_many's).
    assert {r[0] for r in rows if r[4]} == {"attempts_used", "rank", "serial_key_lock",
                                            "serial_commit_lock", "max_name_length",
                                            "max_stored_signals", "epoch_us",
                                            "timeout_problem", "seconds_interval"}
    # The doorbell (0018) is inlined too, though volatile (it notifies): same SQL-standard
    # body, no rights of its own; and 0021's run id parts (volatile: random), inlined into
    # enqueue's statements; and 0022's deadline rule (volatile: clock_timestamp()), inlined
    # into enqueue and enqueue_many. (The status statements' counter bump, 0020, is PL/pgSQL
    # since 0023: a definer with its search_path, like the rest.)
    helpers = ("_ring", "new_run_id", "new_run_salt", "deadline_problem")
    inlined = {name for name, definer, config, public, rule in rows
               if name in helpers and not definer and not config}
    assert inlined == set(helpers)
    # The hot statements' functions (runpool.pooled) are the worker's own statements, run
    # with the worker's rights, and SET-free (a SET would undo their set_config(..., true)).
    hot = {h.function.decode() for h in HOT_STATEMENTS}
    assert {name for name, definer, config, *_ in rows
            if name in hot and not definer and not config} == hot
    bad = [(name, definer, config, public) for name, definer, config, public, rule in rows
           if public or (not rule and name not in inlined and name not in hot
                         and (not definer or "search_path=" not in config))]
    assert bad == []
