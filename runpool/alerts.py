"""Dead-letter alerts: every run that enters 'failed' is posted to RUNPOOL_ALERT_WEBHOOK.

The alert is written by a trigger (migration 0015_ops) into runpool.alerts in the very transaction
that failed the run, whatever failed it (an outcome, the reaper, a deadline), so it cannot be
lost between the failure and the post. An AlertSender in each pool with a webhook takes due
alerts (SKIP LOCKED, each held past its request's timeout so no other sender takes it
meanwhile), posts them one by one from a thread of its own, and marks them delivered, or due
again after an exponential backoff. At least once: a sender that dies after the receiver
answered and before the mark posts that alert again (same `id`: receivers deduplicate on it).
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded

__all__ = ["Alert", "AlertSender", "backoff_seconds"]

logger = logging.getLogger("runpool.alerts")

# Seconds between two looks for due alerts (a cheap read of a partial index).
POLL_SECONDS: Final = 1.0
# One request's timeout.
REQUEST_SECONDS: Final = 10.0
# Alerts taken per look (posted one after another), each held for longer than posting the
# whole batch can take, so no other sender takes one of them meanwhile.
BATCH: Final = 5
HOLD_SECONDS: Final = (BATCH + 2) * REQUEST_SECONDS
# Backoff after a failed post: 1 s, 2 s, 4 s ... capped.
MAX_BACKOFF_SECONDS: Final = 300.0
DB_SECONDS: Final = 10.0

# Take up to %(limit)s due alerts: each is held past a request's timeout, so no other sender
# takes it meanwhile; a sender that dies leaves it due again after that.
TAKE: Final = """
UPDATE runpool.alerts a SET next_at = now() + make_interval(secs => %(hold)s),
                            tries = a.tries + 1
FROM (SELECT id FROM runpool.alerts
      WHERE delivered_at IS NULL AND next_at <= now()
      ORDER BY next_at LIMIT %(limit)s
      FOR UPDATE SKIP LOCKED) due
WHERE a.id = due.id
RETURNING a.id, a.run_id, a.tenant, a.handler, a.reason, a.message, a.attempts, a.tries,
          a.created_at
"""
# The receiver took it.
DELIVERED: Final = """
UPDATE runpool.alerts SET delivered_at = now(), last_error = NULL
WHERE id = %(id)s AND delivered_at IS NULL
"""
# The post failed: due again after its backoff, with the reason kept for operators.
FAILED: Final = """
UPDATE runpool.alerts SET next_at = now() + make_interval(secs => %(delay)s),
                          last_error = left(%(error)s, 1000)
WHERE id = %(id)s AND delivered_at IS NULL
"""


def backoff_seconds(tries: int) -> float:
    """Delay after the `tries`-th failed post: exponential, capped, with jitter (half to
    full) so a receiver that comes back is not hit by every alert at the same instant."""
    return min(2.0 ** (tries - 1), MAX_BACKOFF_SECONDS) * random.uniform(0.5, 1.0)


def _slack(text: str) -> str:
    """Slack's mrkdwn escapes: a tenant or message cannot inject links or mentions."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@dataclass(frozen=True, slots=True)
class Alert:
    id: str
    run_id: str
    tenant: str
    handler: str
    reason: str | None
    message: str | None
    attempts: int
    tries: int
    failed_at: str

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> Alert:
        return cls(id=str(row["id"]), run_id=str(row["run_id"]), tenant=row["tenant"],
                   handler=row["handler"], reason=row["reason"], message=row["message"],
                   attempts=row["attempts"], tries=row["tries"],
                   failed_at=row["created_at"].isoformat())

    def document(self) -> dict[str, Any]:
        """What the webhook receives: the contract's top-level keys, plus `message` and
        `failed_at`; `text` is what Slack (and compatible receivers) show."""
        reason = self.reason or "unknown"
        text = (f":rotating_light: runpool run `{self.run_id}` failed: *{_slack(reason)}*"
                f" (handler `{_slack(self.handler)}`, tenant `{_slack(self.tenant)}`,"
                f" {self.attempts} attempt{'s' if self.attempts != 1 else ''})")
        if self.message:
            text += f"\n>{_slack(self.message[:500])}"
        return {"id": self.id, "run_id": self.run_id, "tenant": self.tenant,
                "handler": self.handler, "reason": self.reason, "attempts": self.attempts,
                "text": text, "message": self.message, "failed_at": self.failed_at}


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
                    sent = await self.send_due()
                except (psycopg.Error, TimeoutError) as exc:
                    logger.warning("alert outbox unavailable: %r", exc,
                                   extra={"action": "alerts_failed", **self._log})
                    sent = 0
                except Exception:
                    # Alerts are not worth a worker: a bug here is logged, the pool goes on.
                    logger.exception("alert sender failed; trying again",
                                     extra={"action": "alerts_failed", **self._log})
                    sent = 0
                if sent < BATCH:
                    await asyncio.sleep(POLL_SECONDS * random.uniform(0.75, 1.25))
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def send_due(self) -> int:
        """Post the alerts due now (up to BATCH); returns how many were taken."""
        async with bounded(self._pool, DB_SECONDS) as conn:
            cur = conn.cursor(row_factory=dict_row)
            await cur.execute(TAKE, {"hold": HOLD_SECONDS, "limit": BATCH})
            alerts = [Alert.from_row(r) for r in await cur.fetchall()]
        loop = asyncio.get_running_loop()
        for alert in alerts:
            extra = {"run_id": alert.run_id, "alert_id": alert.id, **self._log}
            try:
                await loop.run_in_executor(self._executor, post, self._url, alert.document())
            except Exception as exc:
                # Whatever the receiver did (refused, timed out, answered 500, answered
                # something that is not HTTP at all): not delivered, tried again later.
                delay = backoff_seconds(alert.tries)
                logger.warning("alert %s not delivered (try %d): %s; again in %.1fs", alert.id,
                               alert.tries, _describe(exc), delay,
                               extra={"action": "alert_retry", **extra})
                await self._mark(FAILED, {"id": alert.id, "delay": delay,
                                          "error": _describe(exc)})
                continue
            logger.info("alert %s delivered for run %s", alert.id, alert.run_id,
                        extra={"action": "alert_delivered", **extra})
            await self._mark(DELIVERED, {"id": alert.id})
        return len(alerts)

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
