"""W2's path (a run enqueued into an idle pool, enqueue commit -> handler start): what it costs
the worker, counted, not timed."""

from __future__ import annotations

import json
import signal
import uuid
from typing import Any

import psycopg

import runpool
from tests.helpers import running_pool, status_of, wait_for

RUNS = 10
# A pool's LISTEN connection is up (the worker hears the doorbell).
LISTENING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
             " AND query ~* '^\\s*LISTEN'")


def _stopped_claims(log: str) -> dict[str, Any]:
    """The `claims` summary of the worker's last line (worker_stopped)."""
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    (stopped,) = [d for d in lines if d.get("action") == "worker_stopped"]
    return dict(stopped["claims"])


def _wait_succeeded(conn: psycopg.Connection, run_id: uuid.UUID) -> None:
    wait_for(lambda: status_of(conn, run_id) == "succeeded", what=f"run {run_id}")


def test_wakeup__a_run_into_an_idle_pool_costs_one_claim_besides_its_outcomes_refill(
        conn: psycopg.Connection, dsn: str) -> None:
    """Each run, enqueued once the previous one has ended, is claimed by the doorbell's claim;
    its outcome batch's refill finds nothing, and its freed slot claims no more (that refill
    covered it): two claims per run. Before: a third claim per run, after the slot freed,
    which found nothing, and delayed any doorbell that rang meanwhile by its round trip."""
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
    # Two at start-up (the loop's first, and the wake-up at its LISTEN's connect), then two
    # per run; the slack: a doorbell claim that comes between a refill and its slot's vacate
    # makes the vacate claim again (safe side). Main's code: 3 per run (32 here).
    assert claims["n"] <= 2 * RUNS + 4, claims
