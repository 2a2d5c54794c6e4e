"""Dead-letter alerts: every run that enters 'failed' is posted to RUNPOOL_ALERT_WEBHOOK.

The alert is written by a trigger (migration 0015_ops) into runpool.alerts in the very transaction
that failed the run, whatever failed it (an outcome, the reaper, a deadline), so it cannot be
lost between the failure and the post. An AlertSender in each pool with a webhook looks for due
alerts every second and takes them by tenant: up to GROUPS tenants, those whose oldest due alert
is oldest first, and up to PER_POST of each one's oldest (SKIP LOCKED, each held past the look's
requests so no other sender takes it meanwhile). Each tenant's alerts go in one post (see
alert_documents: one alert is posted as it always was), so a tenant failing 10,000 runs costs
a hundred posts rather than 10,000, and the other tenants' alerts ride the next look beside
it instead of queueing behind the flood. A batch is marked delivered, or due again after an
exponential backoff, as one. At least once: a sender that dies after the receiver answered
and before the mark posts those alerts again (same alert ids: receivers deduplicate on them).
No transaction is open while a request is in flight, and the worker's event loop never waits
for a receiver.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from .alert_documents import Alert, batch_document
from .deadlines import bounded

__all__ = ["AlertSender", "backoff_seconds"]

logger = logging.getLogger("runpool.alerts")

# Seconds between two looks for due alerts (a cheap read of a partial index).
POLL_SECONDS: Final = 1.0
# One request's timeout.
REQUEST_SECONDS: Final = 10.0
# Tenants served per look, and alerts a post carries at most (a bounded document: each
# alert's message is at most 2,000 characters). Every alert of a look is held for longer than
# posting the whole look can take, so no other sender takes one of them meanwhile.
GROUPS: Final = 5
PER_POST: Final = 100
HOLD_SECONDS: Final = (GROUPS + 2) * REQUEST_SECONDS
# Backoff after a failed post: 1 s, 2 s, 4 s ... capped.
MAX_BACKOFF_SECONDS: Final = 300.0
DB_SECONDS: Final = 10.0

# Take due alerts by tenant: walk the tenants with a due alert (a loose scan of
# alerts_due_by_tenant, one probe a tenant), keep the %(groups)s whose oldest due alert is
# oldest, and take up to %(per)s of each one's oldest, each held %(hold)s seconds (a sender
# that dies leaves them due again after that).
TAKE: Final = """
WITH RECURSIVE tenants(tenant) AS (
    (SELECT tenant FROM runpool.alerts
     WHERE delivered_at IS NULL AND next_at <= now() ORDER BY tenant LIMIT 1)
    UNION ALL
    SELECT (SELECT a.tenant FROM runpool.alerts a
            WHERE a.delivered_at IS NULL AND a.next_at <= now() AND a.tenant > t.tenant
            ORDER BY a.tenant LIMIT 1)
    FROM tenants t WHERE t.tenant IS NOT NULL
), heads AS (
    SELECT t.tenant FROM tenants t
    CROSS JOIN LATERAL (SELECT min(a.next_at) AS oldest FROM runpool.alerts a
                        WHERE a.delivered_at IS NULL AND a.tenant = t.tenant
                          AND a.next_at <= now()) h
    WHERE t.tenant IS NOT NULL
    ORDER BY h.oldest LIMIT %(groups)s
), due AS (
    SELECT d.id FROM heads h
    CROSS JOIN LATERAL (SELECT a.id FROM runpool.alerts a
                        WHERE a.delivered_at IS NULL AND a.tenant = h.tenant
                          AND a.next_at <= now()
                        ORDER BY a.next_at LIMIT %(per)s
                        FOR UPDATE SKIP LOCKED) d
)
UPDATE runpool.alerts a SET next_at = now() + make_interval(secs => %(hold)s),
                            tries = a.tries + 1
FROM due WHERE a.id = due.id
RETURNING a.id, a.run_id, a.tenant, a.handler, a.reason, a.message, a.attempts, a.tries,
          a.created_at
"""
# The receiver took it.
DELIVERED: Final = """
UPDATE runpool.alerts SET delivered_at = now(), last_error = NULL
WHERE id = ANY(%(ids)s) AND delivered_at IS NULL
"""
# The post failed: due again after its backoff (together, so the batch stays one), with the
# reason kept for operators.
FAILED: Final = """
UPDATE runpool.alerts SET next_at = now() + make_interval(secs => %(delay)s),
                          last_error = left(%(error)s, 1000)
WHERE id = ANY(%(ids)s) AND delivered_at IS NULL
"""


def backoff_seconds(tries: int) -> float:
    """Delay after the `tries`-th failed post: exponential, capped, with jitter (half to
    full) so a receiver that comes back is not hit by every alert at the same instant."""
    return min(2.0 ** (tries - 1), MAX_BACKOFF_SECONDS) * random.uniform(0.5, 1.0)


def post(url: str, document: dict[str, Any]) -> None:
    """POST the document as JSON; raises on anything but a 2xx answer."""
    request = urllib.request.Request(
        url, data=json.dumps(document).encode(), method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "runpool-alerts",
                 "Idempotency-Key": document["id"]})
    with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as response:
        response.read(65536)


class AlertSender:
    """A pool's sender of the outbox (see the module docstring)."""

    def __init__(self, pool: AsyncConnectionPool, url: str, *, log: dict[str, str]) -> None:
        self._pool = pool
        self._url = url
        self._log = log
        # Its own thread: a receiver that hangs holds this thread, never a handler's.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="runpool-alerts")

    async def run(self) -> None:
        """Until cancelled; a database error is logged and the next look tries again."""
        try:
            while True:
                try:
                    full = await self.send_due()
                except (psycopg.Error, TimeoutError) as exc:
                    logger.warning("alert outbox unavailable: %r", exc,
                                   extra={"action": "alerts_failed", **self._log})
                    full = False
                except Exception:
                    # Alerts are not worth a worker: a bug here is logged, the pool goes on.
                    logger.exception("alert sender failed; trying again",
                                     extra={"action": "alerts_failed", **self._log})
                    full = False
                if not full:
                    await asyncio.sleep(POLL_SECONDS * random.uniform(0.75, 1.25))
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def send_due(self) -> bool:
        """Post the alerts due now, one post per tenant; True when a post was full (more
        may be due at once)."""
        async with bounded(self._pool, DB_SECONDS) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(TAKE, {"hold": HOLD_SECONDS, "groups": GROUPS, "per": PER_POST})
            alerts = [Alert.from_row(r) for r in await cur.fetchall()]
        # Each tenant's alerts in one post, oldest first; the tenant of the oldest goes first.
        alerts.sort(key=lambda a: (a.failed_at, a.id))
        by_tenant: dict[str, list[Alert]] = {}
        for alert in alerts:
            by_tenant.setdefault(alert.tenant, []).append(alert)
        batches = list(by_tenant.values())
        for batch in batches:
            await self._send(batch)
        return any(len(b) >= PER_POST for b in batches)

    async def _send(self, batch: list[Alert]) -> None:
        document = batch_document(batch)
        ids = [uuid.UUID(a.id) for a in batch]
        extra = {"run_id": batch[0].run_id, "alert_id": document["id"], "alerts": len(batch),
                 **self._log}
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, post, self._url, document)
        except Exception as exc:
            # Whatever the receiver did (refused, timed out, answered 500, answered something
            # that is not HTTP at all): not delivered, tried again later, as one batch.
            delay = backoff_seconds(max(a.tries for a in batch))
            logger.warning("alert %s (%d alerts) not delivered (try %d): %s; again in %.1fs",
                           document["id"], len(batch), batch[0].tries, _describe(exc), delay,
                           extra={"action": "alert_retry", **extra})
            await self._mark(FAILED, {"ids": ids, "delay": delay, "error": _describe(exc)})
            return
        logger.info("alert %s delivered (%d alerts, tenant %s)", document["id"], len(batch),
                    batch[0].tenant, extra={"action": "alert_delivered", **extra})
        await self._mark(DELIVERED, {"ids": ids})

    async def _mark(self, query: Any, params: dict[str, Any]) -> None:
        # Failing to mark is harmless: the hold expires and the alert is posted again.
        try:
            async with bounded(self._pool, DB_SECONDS) as conn:
                await conn.execute(query, params)
        except (psycopg.Error, TimeoutError) as exc:
            logger.warning("could not record an alert's delivery: %r", exc,
                           extra={"action": "alerts_failed", **self._log})


def _describe(exc: BaseException) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}"
    if isinstance(exc, urllib.error.URLError):
        return f"unreachable: {exc.reason}"
    return repr(exc)
