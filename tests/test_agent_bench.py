"""W11's harness says where a slow checkpoint write's time went: garbage-collection pauses in
the worker (runpool.harness.pauses), its event loop's lateness, and what the server's backends
were doing (runpool.harness.measure.ActivitySampler) — measured, not assumed; and a turn an
earlier attempt committed counts no write."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import runpool
from runpool.harness import pauses
from runpool.harness.agent_workloads import w11_agent_load
from runpool.harness.measure import SAMPLER, ActivitySampler
from runpool.testing.pools import running_pool, wait_for
from tests.helpers import run_row, scalar


@pytest.fixture
def watching() -> Iterator[None]:
    pauses.watch()
    yield
    gc.callbacks.remove(pauses._timed)


def test_paused_ms__clips_each_pause_to_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pauses, "_pauses", [(10.0, 10.004), (20.0, 20.010)])
    assert pauses.paused_ms(10.001, 10.003) == pytest.approx(2.0)  # inside one pause
    assert pauses.paused_ms(9.0, 10.002) == pytest.approx(2.0)  # its start clipped
    assert pauses.paused_ms(10.003, 15.0) == pytest.approx(1.0)  # its end clipped
    assert pauses.paused_ms(10.005, 19.0) == 0.0  # between the two
    assert pauses.paused_ms(9.0, 21.0) == pytest.approx(14.0)  # both whole
    assert pauses.paused_ms(20.005, 30.0) == pytest.approx(5.0)


def test_paused_ms__times_this_processes_collections_once(watching: None) -> None:
    pauses.watch()  # a second call adds no second timer
    assert gc.callbacks.count(pauses._timed) == 1
    before = time.perf_counter()
    garbage = [[i] for i in range(200_000)]  # a collection with something to walk
    gc.collect()
    del garbage
    middle = time.perf_counter()
    assert pauses.paused_ms(before, middle) > 0.0
    assert pauses.paused_ms(middle, time.perf_counter()) == 0.0


def test_paused_ms__a_reader_survives_collections_in_another_thread(watching: None,
                                                                   monkeypatch: pytest.MonkeyPatch
                                                                   ) -> None:
    # A full list of pauses, read whole while another thread's collections append to it (a
    # deque raised "mutated during iteration" here).
    monkeypatch.setattr(pauses, "KEPT", 64)
    monkeypatch.setattr(pauses, "_pauses", [(float(i), i + 0.5) for i in range(128)])
    stop = threading.Event()

    def collect() -> None:
        while not stop.is_set():
            gc.collect(0)

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    try:
        for _ in range(2000):
            pauses.paused_ms(0.0, time.perf_counter())
    finally:
        stop.set()
        collector.join(10)
    assert len(pauses._pauses) <= 2 * pauses.KEPT  # trimmed as it grew


def test_activity_sampler__sees_a_backend_waiting_for_a_lock(dsn: str, server_dsn: str) -> None:
    name = str(conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as waiter:
        holder.execute("SELECT pg_advisory_xact_lock(4242)")
        blocked = threading.Thread(
            target=lambda: waiter.execute("SELECT pg_advisory_lock(4242), pg_sleep(0)"),
            daemon=True)
        with ActivitySampler(server_dsn, name) as sampler:
            blocked.start()
            wait_for(lambda: sampler.samples >= 20 and sampler.kinds.get("advisory"), 30)
        holder.rollback()
        blocked.join(10)
    assert sampler.error is None
    assert max(sampler.waiting) == 1 and max(sampler.active) >= 1
    events = sampler.mean(sampler.events)
    assert events.get("Lock:advisory", 0) > 0
    assert list(events.values()) == sorted(events.values(), reverse=True)


def test_activity_sampler__a_cut_connection_stops_it_and_says_so(dsn: str,
                                                                  server_dsn: str) -> None:
    name = str(conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        with ActivitySampler(server_dsn, name) as sampler:
            wait_for(lambda: sampler.samples >= 3, 30)
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE application_name = %s", (SAMPLER,))
            wait_for(lambda: sampler.error is not None, 30)
            seen = sampler.samples
    assert sampler.error is not None and "terminat" in sampler.error.lower()
    assert sampler.samples == seen  # nothing more after the cut


def test_agent__a_turn_an_earlier_attempt_committed_counts_no_write(dsn: str,
                                                                     conn: psycopg.Connection
                                                                     ) -> None:
    # A real worker SIGKILLed after two committed turns; the next attempt replays them.
    turns = 5
    run_id = runpool.enqueue(conn, "acme", "agent", {"turns": turns, "low": 0.3, "high": 0.4})
    with running_pool(dsn, "runpool.harness.benchapp:app", workers=1, lease_seconds=1.5):
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                                " AND status = 'succeeded'", run_id) >= 2, what="two turns")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", run_id)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=60,
                 what="the resumed run")
    row = run_row(conn, run_id)
    replayed = scalar(conn, "SELECT count(*) FROM runpool.tool_calls WHERE run_id = %s"
                      " AND attempt = 1 AND status = 'succeeded'", run_id)
    result = row["result"]
    assert row["attempt"] == 2 and replayed >= 2
    assert len(result["tool_ms"]) == len(result["lag_ms"]) == turns
    # Only the turns this attempt wrote: no checkpoint of a replayed turn measured from the
    # process's start.
    assert len(result["checkpoint_ms"]) == len(result["gc_ms"]) == turns - replayed
    assert all(0 < ms < 10_000 for ms in result["checkpoint_ms"])
    assert all(0 <= gc_ms <= ms for gc_ms, ms in zip(result["gc_ms"], result["checkpoint_ms"],
                                                     strict=True))
    assert all(0 <= ms < 10_000 for ms in result["lag_ms"])


def test_w11__reports_where_the_write_time_went(server_dsn: str) -> None:
    row = w11_agent_load(server_dsn, workers=1, slots=6, runs=6, turns=4, low=0.01,
                         high=0.02, pool_size=4)
    assert row["ended"] == 6 and row["not_succeeded"] == 0 and row["lease_losses"] == 0
    assert 0 <= row["loop_lag_p50_ms"] <= row["loop_lag_p99_ms"]
    assert 0 <= row["checkpoints_gc_paused_pct"] <= 100
    assert 0 <= row["checkpoint_gc_pause_max_ms"]
    assert 0 < row["checkpoint_p99_ms_less_gc"] <= row["checkpoint_p99_ms"]
    # The workers' writes ran on the server: some backend was seen at work (on a CPU or in a
    # wait) in the samples.
    assert row["server_backends"] and row["server_samples"] > 0, row
    assert "server_sampler_error" not in row
