"""W11's harness says where a slow checkpoint write's time went: garbage-collection pauses in
the worker (runpool.harness.pauses), its event loop's lateness, and what the server's backends
were doing (runpool.harness.measure.ActivitySampler) — measured, not assumed."""

from __future__ import annotations

import gc
import threading
import time

import psycopg
from psycopg.conninfo import conninfo_to_dict

from runpool.harness import pauses
from runpool.harness.agent_workloads import w11_agent_load
from runpool.harness.measure import ActivitySampler
from runpool.testing.pools import wait_for


def test_paused_ms__counts_only_the_collections_inside_the_interval() -> None:
    pauses.watch()
    pauses.watch()  # once: a second call adds no second timer
    before = time.perf_counter()
    garbage = [[i] for i in range(200_000)]  # a collection with something to walk
    gc.collect()
    del garbage
    middle = time.perf_counter()
    time.sleep(0.01)
    after = time.perf_counter()
    inside = pauses.paused_ms(before, middle)
    assert inside > 0.0
    assert pauses.paused_ms(before, after) == inside  # no collection in the sleep
    assert pauses.paused_ms(middle, after) == 0.0
    # Clipped to the interval: half of it counts half of the pause at most.
    assert pauses.paused_ms(before, before + (middle - before) / 2) <= inside


def test_activity_sampler__sees_a_backend_waiting_for_a_lock_and_one_running(
        dsn: str, server_dsn: str) -> None:
    name = str(conninfo_to_dict(dsn)["dbname"])
    with psycopg.connect(dsn) as holder, psycopg.connect(dsn, autocommit=True) as waiter:
        holder.execute("SELECT pg_advisory_xact_lock(4242)")
        blocked = threading.Thread(
            target=lambda: waiter.execute("SELECT pg_advisory_lock(4242), pg_sleep(0)"),
            daemon=True)
        with ActivitySampler(server_dsn, name) as sampler:
            blocked.start()
            wait_for(lambda: len(sampler.waiting) >= 20 and sampler.kinds.get("advisory"), 30)
        holder.rollback()
        blocked.join(10)
    assert max(sampler.waiting) == 1 and max(sampler.active) >= 1
    events = sampler.mean(sampler.events)
    assert events.get("Lock:advisory", 0) > 0
    assert list(events.values()) == sorted(events.values(), reverse=True)


def test_w11__reports_where_the_write_time_went(server_dsn: str) -> None:
    row = w11_agent_load(server_dsn, workers=1, slots=6, runs=6, turns=4, low=0.01,
                         high=0.02, pool_size=4)
    assert row["ended"] == 6 and row["not_succeeded"] == 0 and row["lease_losses"] == 0
    assert 0 <= row["loop_lag_p50_ms"] <= row["loop_lag_p99_ms"]
    assert 0 <= row["checkpoints_gc_paused_pct"] <= 100
    assert row["checkpoint_gc_pause_max_ms"] >= 0
    assert row["checkpoint_p99_ms_unpaused"] is None or row["checkpoint_p99_ms_unpaused"] > 0
    # The workers' writes ran on the server: some backend was seen at work (on a CPU or in a
    # wait) in the samples.
    assert row["server_backends"], row
