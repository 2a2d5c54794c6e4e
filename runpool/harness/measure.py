"""What the workloads measure with: counters read from PostgreSQL, bounded waits, percentiles."""

from __future__ import annotations

import os
import statistics
import threading
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Final

import psycopg

from ..testing.pools import PoolProcess, running_pool, wait_for

__all__ = ["BENCH_APP", "CLEAR_SNAPSHOT", "COUNT_DONE", "DRAIN_RATE", "LIVE_WORKERS", "XACTS",
           "ActivitySampler", "bench_pool", "cpu_seconds", "median_of", "percentile",
           "wait_until"]

BENCH_APP: Final = "runpool.harness.benchapp:app"

# Server-wide transaction counter of one database (read from another database, so the
# reading itself is not counted).
XACTS: Final = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CLEAR_SNAPSHOT: Final = "SELECT pg_stat_clear_snapshot()"
# Drain rate measured by the database's own clock, from first claim to last finish.
DRAIN_RATE: Final = """
SELECT count(*) / greatest(extract(epoch FROM max(finished_at) - min(started_at)), 1e-6)
FROM runpool.runs WHERE status = 'succeeded'
"""
COUNT_DONE: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'succeeded'"
LIVE_WORKERS: Final = "SELECT count(*) FROM runpool.workers WHERE stopped_at IS NULL"
# The sampler's session, by name in pg_stat_activity.
SAMPLER: Final = "runpool-activity-sampler"
# A sample that takes longer is cut (and the sampler stops: ActivitySampler.error).
SAMPLE_OPTIONS: Final = "-c statement_timeout=2000"
# The backends of one database by what they are doing: running a statement or not, and what
# they wait for (NULL: on a CPU, or waiting for one).
ACTIVITY: Final = """
SELECT state = 'active', wait_event_type, wait_event, count(*) FROM pg_stat_activity
WHERE datname = %s AND pid <> pg_backend_pid()
GROUP BY 1, 2, 3
"""


class ActivitySampler:
    """pg_stat_activity of one database every 20 ms, on a connection of its own, in a thread:
    how many backends wait for a lock (and which kind), run a statement, and where the running
    ones are (on a CPU or waiting for one, or in a wait event: the WAL's flush, a lock, ...).
    Each sample is one cheap statement; at 50 a second it costs the server little beside a
    workload, but it is not free. A sampler that stopped early (its connection cut, a sample
    over SAMPLE_OPTIONS' statement_timeout) keeps what it saw and says why in `error`;
    `samples` says how many."""

    def __init__(self, server: str, dbname: str) -> None:
        self._server = server
        self._dbname = dbname
        self.waiting: list[int] = []
        self.active: list[int] = []
        # Running backends by wait event ("IO:WALSync", "Lock:object", ...; "CPU": none),
        # summed over the samples. (A backend waiting for a lock is always running one.)
        self.events: dict[str, int] = {}
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def samples(self) -> int:
        return len(self.active)

    def _run(self) -> None:
        try:
            with psycopg.connect(self._server, autocommit=True, connect_timeout=10,
                                 options=SAMPLE_OPTIONS, application_name=SAMPLER) as conn:
                while not self._stop.wait(0.02):
                    self._sample(conn)
        except Exception as exc:  # the workload goes on; its report says the samples stopped
            self.error = f"{type(exc).__name__}: {exc}"

    def _sample(self, conn: psycopg.Connection[Any]) -> None:
        waiting = active = 0
        for running, kind, event, n in conn.execute(ACTIVITY, (self._dbname,)):
            if kind == "Lock":
                waiting += n
            if running:
                active += n
                where = f"{kind}:{event}" if kind else "CPU"
                self.events[where] = self.events.get(where, 0) + n
        self.waiting.append(waiting)
        self.active.append(active)

    @property
    def kinds(self) -> dict[str, int]:
        """Lock waits by kind (tuple, transactionid, advisory, ...), summed over the samples:
        the events of type Lock."""
        return {e.removeprefix("Lock:"): n for e, n in self.events.items()
                if e.startswith("Lock:")}

    def mean(self, tally: dict[str, int], *, floor: float = 0.01) -> dict[str, float]:
        """A tally (kinds, events) as the mean number of backends per sample, the largest
        first; those under `floor` left out."""
        samples = max(self.samples, 1)
        means = {k: round(v / samples, 2) for k, v in tally.items()}
        return dict(sorted(((k, v) for k, v in means.items() if v >= floor),
                           key=lambda kv: -kv[1]))

    def __enter__(self) -> ActivitySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        # A sample in flight ends within SAMPLE_OPTIONS' timeout; a connection attempt within
        # connect_timeout.
        self._thread.join(15)
        if self._thread.is_alive() and self.error is None:
            self.error = "the sampler did not stop within 15 s"


def bench_pool(dsn: str, **settings: Any) -> AbstractContextManager[PoolProcess]:
    """A pool serving the bench handlers, drained at the end."""
    return running_pool(dsn, BENCH_APP, stop="drain", output="discard", **settings)


def wait_until(conn: psycopg.Connection[Any], query: Any, target: int, timeout: float) -> None:
    """Until `query`'s first column reaches `target` (AssertionError after `timeout` s)."""

    def reached() -> bool:
        row = conn.execute(query).fetchone()
        return bool(row and row[0] >= target)

    wait_for(reached, timeout, what=f"the benchmark to reach {target}")


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def median_of(results: list[dict[str, Any]]) -> dict[str, Any]:
    merged = dict(results[0])
    for key, value in merged.items():
        if isinstance(value, float):
            merged[key] = round(statistics.median(r[key] for r in results), 3)
    if len(results) > 1:
        merged["repeats"] = len(results)
    return merged


_TICKS: Final = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of live processes (Linux /proc), in seconds; gone ones count 0."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICKS
