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


async def plan_ahead(conn: psycopg.AsyncConnection[Any], *, worker_id: uuid.UUID,
                     lease_seconds: float, handlers: Sequence[str]) -> None:
    """Prepare the claim's and the outcome batch's statements on a new worker session, each
    run once on parameters that match nothing (no tenant is chosen, no run claimed, no
    outcome written); and the claim's promotions of due runs.

    Why: psycopg prepares a statement on its fifth run, so a session's first four claims each
    parsed and planned lock_tenants, claim_runs and finish_runs anew (2-8 ms each on this
    machine), and the fifth planned them again to keep: with 6 sessions a pool's first ~24
    claims were that much slower (W2: its first dozen wake-ups 7-24 ms against ~3 ms after,
    and with 300 samples they were its p99). Here the plans are made when the pool opens a
    connection, where no run waits for them. The parameters have the types of the real calls
    (psycopg keys a prepared statement by its text and its parameters' types)."""
    names = list(handlers)
    try:
        await conn.execute(QUERIES["lock_tenants"], {"handlers": names, "limit": 0},
                           prepare=True)
        await conn.execute(QUERIES["claim_runs"], {
            "limit": 0, "worker_id": worker_id, "lease_seconds": lease_seconds,
            "handlers": names}, prepare=True)
        await conn.execute(QUERIES["finish_runs"], finish_params([]), prepare=True)
        # The promotions a claim runs every PROMOTE_INTERVAL: run now, they do what the pool's
        # first claim would (let in runs whose time came).
        await conn.execute(QUERIES["promote_due"], prepare=True)
        await conn.execute(QUERIES["wake_due"], prepare=True)
    except psycopg.Error as exc:
        # Only an optimisation: the statements are planned at their first use instead.
        logger.warning("planning the worker's statements ahead failed: %r", exc,
                       extra={"action": "plan_ahead_failed", "worker_id": str(worker_id)})
