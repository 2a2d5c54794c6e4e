"""W2's path (a run enqueued into an idle pool, enqueue commit -> handler start): what it costs
the worker, counted, not timed."""

from __future__ import annotations

import functools
import json
import signal
import time
import uuid
from typing import Any

import psycopg

import runpool
from tests.helpers import LISTENING, running_pool, status_of, wait_for

RUNS = 10


def _stopped_claims(log: str) -> dict[str, Any]:
    """The `claims` summary of the worker's last line (worker_stopped)."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    (stopped,) = [d for d in lines if d.get("action") == "worker_stopped"]
    return dict(stopped["claims"])


def _both_succeeded(conn: psycopg.Connection, x: uuid.UUID, y: uuid.UUID) -> bool:
    return status_of(conn, x) == status_of(conn, y) == "succeeded"


def _wait_succeeded(conn: psycopg.Connection, run_id: uuid.UUID) -> None:
    wait_for(lambda: status_of(conn, run_id) == "succeeded", what=f"run {run_id}")


def test_wakeup__a_run_into_an_idle_pool_costs_at_most_three_claims(
        conn: psycopg.Connection, dsn: str) -> None:
    """Each run, enqueued once the previous one has ended, is claimed by the doorbell's claim;
    its outcome batch's refill finds nothing, and its freed slot claims once more (a doorbell
    may have rung while the slot was busy: see the next test): three claims per run, and no
    more (the claims' statements are counted in the README's W2 bullet)."""
    with running_pool(dsn, poll_seconds=60, env={"RUNPOOL_LOG_FORMAT": "json"}) as pool:
        wait_for(lambda: conn.execute(LISTENING).fetchone() == (1,), what="the LISTEN")
        for i in range(RUNS):
            run_id = runpool.enqueue(conn, "acme", "noop", {"i": i})
            conn.commit()
            _wait_succeeded(conn, run_id)
        pool.send_signal(signal.SIGTERM)
        pool.wait(60)
        claims = _stopped_claims(pool.log())
    assert claims["runs"] == RUNS
    # Two at start-up (the loop's first, and the wake-up at its LISTEN's connect), then three
    # per run (32 here), and a little slack for a poll.
    assert claims["n"] <= 3 * RUNS + 4, claims


# Far beyond any wait below, stretched for load (10x at most): a run the doorbell did not
# start would wait for the poll.
LONG_POLL = 300


def test_wakeup__a_doorbell_while_the_only_slot_is_busy_is_not_lost(
        conn: psycopg.Connection, dsn: str) -> None:
    """Run y is enqueued a moment after run x into a one-slot pool: its doorbell may ring while
    x still holds the slot (the loop claims nothing then), and x's outcome batch's refill may
    have looked before y was committed. x's freed slot must then claim again: when it relied
    on the refill instead (coming back short, it "covered" the vacate), y waited for the poll
    in about one try of six (attack3)."""
    with running_pool(dsn, concurrency=1, poll_seconds=LONG_POLL) as pool:
        wait_for(lambda: conn.execute(LISTENING).fetchone() == (1,), what="the LISTEN")
        for i in range(30):
            x = runpool.enqueue(conn, "a", "noop", {"i": i})
            conn.commit()
            # 0-4 ms apart, as the attack found the window: spread over the tries.
            deadline = time.monotonic() + (i % 5) / 1000
            while time.monotonic() < deadline:
                pass
            y = runpool.enqueue(conn, "b", "noop", {"i": i})
            conn.commit()
            wait_for(functools.partial(_both_succeeded, conn, x, y), timeout=20,
                     what=f"try {i}: both runs, y started by its doorbell")
        assert pool.poll() is None
