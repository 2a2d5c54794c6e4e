"""A worker session plans its hot statements when it opens, not on the first runs it serves."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from .outcomes import finish_params
from .queries import QUERIES
from .trips import Trip

__all__ = ["UPKEEP", "plan_ahead"]

logger = logging.getLogger("runpool.warmup")

# The claim's upkeep, in claim_statements' order: each does what any claim does when it runs
# (return expired leases, end runs past their deadline, heal serial keys, let in runs whose
# time came), so running it once more when a session opens changes nothing a claim would not.
UPKEEP = ("reap_expired", "expire_deadlines", "heal_serial_keys", "schedule_probe",
          "promote_due", "wake_due")


async def plan_ahead(conn: psycopg.AsyncConnection[Any], *, worker_id: uuid.UUID,
                     lease_seconds: float, handlers: Sequence[str]) -> None:
    """Prepare a new worker session's trip statements (runpool.trips) and plan those of the
    claim and the outcome batch: one trip of the upkeep as it is and the rest on parameters
    that match nothing (no tenant is chosen, no run claimed, no outcome written, no worker
    touched before it registers).

    Why: a statement is planned on its first run in a session (a generic plan, kept), 2-8 ms
    for lock_tenants, claim_runs and finish_runs on this machine, and a session's first trip
    also prepares them all; with 6 sessions a pool's first claims paid that (W2: its first
    dozen wake-ups 7-24 ms against ~3 ms after, when psycopg still prepared a statement only
    on its fifth run, and with 300 samples they were its p99). Here the plans are made when
    the pool opens a connection, where no run waits for them."""
    trip = Trip(conn)
    names = list(handlers)
    try:
        for name in UPKEEP:
            await trip.execute(QUERIES[name])
        await trip.execute(QUERIES["touch_worker"], {"worker_id": worker_id})
        await trip.execute(QUERIES["lock_tenants"], {"handlers": names, "limit": 0,
                                                     "roomy": False})
        await trip.execute(QUERIES["claim_runs"], {
            "limit": 0, "worker_id": worker_id, "lease_seconds": lease_seconds,
            "handlers": names})
        await trip.execute(QUERIES["finish_runs"], finish_params([]))
        await trip.send()
    except Exception as exc:
        # Whatever went wrong (a refused statement, a value the session's encoding cannot
        # carry), the session is still good to work: only a broken one is not.
        if conn.broken or conn.closed:
            # The pool must not keep a dead session: it connects again.
            raise
        # Only an optimisation: the statements are planned at their first use instead.
        logger.warning("planning the worker's statements ahead failed: %r", exc,
                       extra={"action": "plan_ahead_failed", "worker_id": str(worker_id)})
