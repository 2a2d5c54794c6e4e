"""`GET /metrics`: the pool's figures in the Prometheus text format (prometheus-client).

A scrape reads bounded queries (a capped probe per tenant of one page, the live workers) and
the in-memory tally of the event log (tally.py), which a background task keeps reading; it
never scans finished history.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response

from .state import Web, web_of
from .tally import Histogram, Key, Tally

__all__ = ["FAILED_CAP", "MAX_TENANTS", "QUEUE_CAP", "metrics"]

# Tenants a scrape reports (by name): the probes, and the series, stay bounded.
MAX_TENANTS: Final = 1000
# A tenant's queue depth is counted up to this many, its runs failed in the last day up to
# FAILED_CAP.
QUEUE_CAP: Final = 100_000
FAILED_CAP: Final = 1000


@dataclass(frozen=True)
class Snapshot:
    tenants: list[dict[str, Any]]
    workers: int
    slots: int


def _counter(name: str, doc: str, labels: list[str], values: Mapping[Key, int]) -> Metric:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _histogram(name: str, doc: str, labels: list[str],
               values: Mapping[Key, Histogram]) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for key, hist in sorted(values.items()):
        family.add_metric(list(key), buckets=hist.cumulative(), sum_value=hist.total)
    return family


class _Families(Collector):
    """One scrape's metric families (prometheus-client's custom collector protocol)."""

    def __init__(self, snap: Snapshot, tally: Tally) -> None:
        self.snap, self.tally = snap, tally

    def collect(self) -> Iterator[Metric]:
        t, snap = self.tally, self.snap
        pair = ["tenant", "handler"]
        yield _counter("runpool_run_attempts_started", "Attempts claimed by a worker",
                       pair, t.started)
        yield _counter("runpool_runs_finished", "Runs that ended, by outcome",
                       [*pair, "outcome"], t.finished)
        yield _counter("runpool_run_retries", "Failed attempts scheduled for a retry",
                       pair, t.retries)
        yield _counter("runpool_reclaims", "Runs reclaimed after their lease expired",
                       pair, t.reclaims)
        yield _counter("runpool_lease_losses",
                       "Attempts whose lease expired (reclaimed, or ended by the reaper)",
                       pair, t.lease_losses)
        yield _counter("runpool_cancel_requests", "Cancellations requested of running runs",
                       pair, t.cancel_requests)
        yield _histogram("runpool_run_wait_seconds", "Queue wait: enqueue to first claim",
                         ["handler"], t.wait)
        yield _histogram("runpool_run_duration_seconds", "Run time of an ending attempt",
                         ["handler"], t.run_time)
        yield _histogram("runpool_cancel_latency_seconds",
                         "Cancellation requested to run ended cancelled", [],
                         {(): t.cancel_latency})
        depth = GaugeMetricFamily(
            "runpool_queue_depth", f"Queued runs (counted up to {QUEUE_CAP} per tenant);"
            " state: ready (can start now) or waiting (scheduled, backoff, serial key,"
            " paused, durable waits)", labels=["tenant", "state"])
        oldest = GaugeMetricFamily("runpool_oldest_wait_seconds",
                                   "Age of the oldest ready run", labels=["tenant"])
        running = GaugeMetricFamily("runpool_running", "Runs with a live lease",
                                    labels=["tenant"])
        stuck = GaugeMetricFamily("runpool_stuck", "Runs whose lease expired, not reclaimed yet",
                                  labels=["tenant"])
        dead = GaugeMetricFamily("runpool_failed_last_day",
                                 f"Runs failed for good in the last 24 h (counted up to"
                                 f" {FAILED_CAP} per tenant)", labels=["tenant"])
        quota = GaugeMetricFamily("runpool_tenant_quota", "A tenant's quota (absent: none)",
                                  labels=["tenant"])
        for row in snap.tenants:
            name = [row["tenant"]]
            depth.add_metric([*name, "ready"], row["ready"])
            depth.add_metric([*name, "waiting"], row["waiting"])
            oldest.add_metric(name, row["oldest_wait_s"] or 0.0)
            running.add_metric(name, row["running"])
            stuck.add_metric(name, row["stuck"])
            dead.add_metric(name, row["failed"])
            if row["quota"] is not None:
                quota.add_metric(name, row["quota"])
        yield from (depth, oldest, running, stuck, dead, quota)
        yield GaugeMetricFamily("runpool_workers", "Live worker processes", value=snap.workers)
        yield GaugeMetricFamily("runpool_worker_slots", "Run slots of the live workers",
                                value=snap.slots)


async def snapshot(web: Web) -> Snapshot:
    async with web.connection(read=True) as conn:
        # Bounded (tally.READ_LIMIT events); the background task keeps the rest small.
        await web.tally.refresh(conn)
        cur = await conn.execute(web.sql["live_workers"])
        workers = await cur.fetchone()
        tenants = await web.rows(conn, "tenants", {"after": "", "limit": MAX_TENANTS,
                                                   "cap": QUEUE_CAP, "failed_cap": FAILED_CAP})
    assert workers is not None
    return Snapshot(tenants, int(workers[0]), int(workers[1]))


async def metrics(request: Request) -> Response:
    web = web_of(request)
    snap = await snapshot(web)
    body = generate_latest(_Families(snap, web.tally))
    return Response(body, media_type=CONTENT_TYPE_LATEST)
