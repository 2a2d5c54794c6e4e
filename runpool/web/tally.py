"""Counters and histograms of what runs did, read from the event log a page at a time.

Totals over the whole history would cost a scan of it on every scrape; instead the tally
starts at the end of the log when the app starts (a counter starting at zero, which is how
Prometheus sees any restarted process) and reads forward, at most READ_LIMIT events a read, by
the event log's primary key. An event is counted once its transaction began at least LAG
seconds ago: a later one may still be uncommitted with a smaller id, and the read stops before
the first event that recent, so it comes in a later read. An event whose transaction commits
more than LAG seconds after it began (runpool's own transactions are short; a caller's open
transaction around a cancel_run may not be) is missed: the counters are an operator's view,
the runs table is the record.
"""

from __future__ import annotations

import asyncio
import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from .sql import SQL

__all__ = ["BUCKETS", "LAG", "READ_LIMIT", "Histogram", "Tally"]

# Seconds an event's transaction must have begun before it is counted (see above).
LAG: Final = 5.0
# Events read at most per read: a read's cost is bounded; a backlog takes several reads.
READ_LIMIT: Final = 50_000
# Queue waits kept per tenant for the console's wait p95.
RECENT_WAITS: Final = 1000
# Histogram bounds, seconds: agent runs last from a second to hours.
BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0,
                  3600.0)

# Event kinds (run_events.kind) that end a run, by its outcome.
OUTCOMES: Final = ("succeeded", "failed", "cancelled")


@dataclass
class Histogram:
    """Observations in BUCKETS (the last count is +Inf), their count and sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, count in zip([*map(str, BUCKETS), "+Inf"], self.counts, strict=True):
            running += count
            out.append((bound, running))
        return out


Key = tuple[str, ...]


@dataclass
class Tally:
    """What the events read so far add up to. Written only by refresh(), under its lock."""

    # Seconds an event's transaction must have begun before it is counted.
    lag: float = LAG
    mark: int | None = None
    started: dict[Key, int] = field(default_factory=dict)  # (tenant, handler)
    finished: dict[Key, int] = field(default_factory=dict)  # (tenant, handler, outcome)
    retries: dict[Key, int] = field(default_factory=dict)  # (tenant, handler)
    reclaims: dict[Key, int] = field(default_factory=dict)  # (tenant, handler)
    lease_losses: dict[Key, int] = field(default_factory=dict)  # (tenant, handler)
    cancel_requests: dict[Key, int] = field(default_factory=dict)  # (tenant, handler)
    wait: dict[Key, Histogram] = field(default_factory=dict)  # (handler,)
    run_time: dict[Key, Histogram] = field(default_factory=dict)  # (handler,)
    cancel_latency: Histogram = field(default_factory=Histogram)
    recent_waits: dict[str, deque[float]] = field(default_factory=dict)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def refresh(self, conn: psycopg.AsyncConnection[Any]) -> int:
        """Read the events committed since the last read; returns how many were read."""
        async with self._lock:
            if self.mark is None:
                cur = await conn.execute(SQL["event_mark"])
                row = await cur.fetchone()
                self.mark = int(row[0]) if row else 0
                return 0
            dcur = conn.cursor(row_factory=dict_row)
            await dcur.execute(SQL["events_since"],
                               {"mark": self.mark, "limit": READ_LIMIT, "lag": self.lag})
            return self.add(await dcur.fetchall())

    def add(self, rows: Iterable[dict[str, Any]]) -> int:
        """Count rows (events_since, in id order) up to the first too recent to be sure of."""
        read = 0
        for ev in rows:
            if ev["recent"]:
                break
            self.mark = ev["id"]
            read += 1
            if ev["tenant"] is None:  # the run was purged since
                continue
            self._count(ev)
        return read

    def _count(self, ev: dict[str, Any]) -> None:
        kind, tenant, handler = ev["kind"], ev["tenant"], ev["handler"]
        pair = (tenant, handler)
        if kind == "claimed":
            _bump(self.started, pair)
            if ev["attempt"] == 1 and ev["since_created"] is not None:
                # Queue wait: enqueue to the first claim.
                wait = max(ev["since_created"], 0.0)
                self.wait.setdefault((handler,), Histogram()).observe(wait)
                self.recent_waits.setdefault(tenant, deque(maxlen=RECENT_WAITS)).append(wait)
        elif kind in OUTCOMES:
            _bump(self.finished, (tenant, handler, kind))
            if ev["since_started"] is not None and ev["since_started"] >= 0:
                self.run_time.setdefault((handler,), Histogram()).observe(ev["since_started"])
            if kind == "cancelled" and ev["since_cancel"] is not None:
                self.cancel_latency.observe(max(ev["since_cancel"], 0.0))
            if ev["reason"] == "lease_expired":  # the reaper ended it
                _bump(self.lease_losses, pair)
        elif kind == "retry_scheduled":
            _bump(self.retries, pair)
        elif kind == "reclaimed":
            _bump(self.reclaims, pair)
            _bump(self.lease_losses, pair)
        elif kind == "cancel_requested":
            _bump(self.cancel_requests, pair)

    def wait_p95(self, tenant: str) -> float | None:
        """The 95th percentile of the last RECENT_WAITS queue waits of a tenant seen here."""
        waits = self.recent_waits.get(tenant)
        if not waits:
            return None
        ordered = sorted(waits)
        return ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]


def _bump(counter: dict[Key, int], key: Key) -> None:
    counter[key] = counter.get(key, 0) + 1
