"""A worker session plans its hot statements when it opens, not on the first runs it serves."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from typing import Any

import psycopg

from .outcomes import finish_params
from .queries import QUERIES

__all__ = ["plan_ahead"]

logger = logging.getLogger("runpool.warmup")

# The claim's upkeep, in claim_statements' order: each does what any claim does when it runs
# (return expired leases, end runs past their deadline, heal serial keys, let in runs whose
# time came), so running it once more when a session opens changes nothing a claim would not.
UPKEEP = ("reap_expired", "expire_deadlines", "heal_serial_keys", "schedule_probe",
          "promote_due", "wake_due")


async def plan_ahead(conn: psycopg.AsyncConnection[Any], *, worker_id: uuid.UUID,
                     lease_seconds: float, handlers: Sequence[str]) -> None:
    """Prepare, on a new worker session, every statement of the claim and the outcome batch:
    the upkeep as it is, the rest run once on parameters that match nothing (no tenant is
    chosen, no run claimed, no outcome written, no worker touched before it registers).

    Why: psycopg prepares a statement on its fifth run, so a session's first four claims each
    parsed and planned lock_tenants, claim_runs and finish_runs anew (2-8 ms each on this
    machine), and the fifth planned them again to keep; the upkeep, which rides a claim once a
    second, stayed unprepared for the first four seconds of each session. With 6 sessions a
    pool's first ~24 claims and most of its first minute's upkeep paid that (W2: its first
    dozen wake-ups 7-24 ms against ~3 ms after, the claims carrying the upkeep 6-10 ms: its
    p95 and p99). Here the plans are made when the pool opens a connection, where no run waits
    for them. The parameters have the types of the real calls (psycopg keys a prepared
    statement by its text and its parameters' types)."""
    names = list(handlers)
    try:
        for name in UPKEEP:
            await conn.execute(QUERIES[name], prepare=True)
        await conn.execute(QUERIES["touch_worker"], {"worker_id": worker_id}, prepare=True)
        await conn.execute(QUERIES["lock_tenants"], {"handlers": names, "limit": 0},
                           prepare=True)
        await conn.execute(QUERIES["claim_runs"], {
            "limit": 0, "worker_id": worker_id, "lease_seconds": lease_seconds,
            "handlers": names}, prepare=True)
        await conn.execute(QUERIES["finish_runs"], finish_params([]), prepare=True)
    except psycopg.Error as exc:
        if conn.broken or conn.closed:
            # The pool must not keep a dead session: it connects again.
            raise
        # Only an optimisation: the statements are planned at their first use instead.
        logger.warning("planning the worker's statements ahead failed: %r", exc,
                       extra={"action": "plan_ahead_failed", "worker_id": str(worker_id)})
