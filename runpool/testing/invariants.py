"""The guarantees runpool makes, checked against a database after a fault scenario or a soak.

`check` reads what the runs left behind; `Watch` samples, while the pool runs, what leaves no
trace afterwards (live leases per tenant and per serial key). Tools that want their real
executions counted record each one in the side table EXECUTIONS_DDL creates.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import psycopg

from ..db import connect

__all__ = ["EXECUTIONS_DDL", "Report", "Watch", "check", "record_execution"]

# One row per real execution of a tool, written by the tool itself, outside runpool's
# transactions: the evidence that a committed call never ran again.
EXECUTIONS_DDL: Final = """
CREATE TABLE IF NOT EXISTS tool_log (
    run_id uuid NOT NULL, call_id text NOT NULL, attempt integer NOT NULL, key text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
)"""
# Records one execution of a tool (its own autocommit connection: the side effect happened),
# at the time the tool ran, read before connecting: a tool cut off from the database (a
# partitioned host's zombie) records itself once the network heals, and stamped at insert it
# looked like an execution after the call had finished (CI, test_hosts_partition).
_RECORD: Final = ("INSERT INTO tool_log (run_id, call_id, attempt, key, at)"
                  " VALUES (%s, %s, %s, %s, %s)")

# Runs not in a terminal state (each with its status).
_NOT_TERMINAL: Final = """
SELECT id, status FROM runpool.runs WHERE status IN ('queued', 'running', 'waiting')
ORDER BY id LIMIT 20"""
# Runs whose history is impossible: a terminal run without exactly one terminal event since
# its last retry_run (a live one with any), or attempts claimed out of order or twice.
_EVENTS: Final = """
SELECT id, status, endings, claims FROM (
    SELECT r.id, r.status,
           count(*) FILTER (WHERE e.kind IN ('succeeded', 'failed', 'cancelled')
                            AND e.id > coalesce(x.retried, 0)) AS endings,
           array_agg(e.attempt ORDER BY e.id) FILTER (WHERE e.kind = 'claimed') AS claims,
           array_agg(DISTINCT e.attempt) FILTER (WHERE e.kind = 'claimed') AS ascending
    FROM runpool.runs r
    JOIN runpool.run_events e ON e.run_id = r.id
    CROSS JOIN LATERAL (SELECT max(p.id) AS retried FROM runpool.run_events p
                        WHERE p.run_id = r.id AND p.kind = 'retried') x
    GROUP BY r.id, r.status
) h
WHERE endings <> CASE WHEN status IN ('succeeded', 'failed', 'cancelled') THEN 1 ELSE 0 END
   OR claims IS DISTINCT FROM ascending
LIMIT 20"""
# Among calls of tools that record their executions: committed calls executed again at or
# after the attempt that committed them (or not by it), or started by an older attempt (a
# zombie) after the commit; and calls whose outcome is unknown executed more than once.
_TOOL_TWICE: Final = """
SELECT run_id, call_id, status, attempt, later, total FROM (
    SELECT c.run_id, c.call_id, c.status, c.attempt, count(l.*) AS total,
           count(l.*) FILTER (WHERE l.attempt >= c.attempt OR l.at > c.finished_at) AS later
    FROM runpool.tool_calls c
    JOIN tool_log l ON (l.run_id, l.call_id) = (c.run_id, c.call_id)
    WHERE c.status <> 'started'
    GROUP BY c.run_id, c.call_id, c.status, c.attempt
) calls
WHERE (status IN ('succeeded', 'failed') AND later <> 1) OR (status = 'unknown' AND total > 1)
LIMIT 20"""
# Finished calls also executed by an earlier attempt that ended alive, by its own outcome (its
# handler raised: retry_scheduled), without committing them: a finished tool's result thrown
# away (an attempt that crashed, froze or was cut off ends by a reclaim instead).
_RESULT_THROWN_AWAY: Final = """
SELECT DISTINCT c.run_id, c.call_id, c.status, c.attempt, l.attempt
FROM runpool.tool_calls c
JOIN tool_log l ON (l.run_id, l.call_id) = (c.run_id, c.call_id)
WHERE c.status <> 'started' AND l.attempt < c.attempt
  AND EXISTS (SELECT 1 FROM runpool.run_events e WHERE e.run_id = c.run_id
              AND e.attempt = l.attempt AND e.kind = 'retry_scheduled')
LIMIT 20"""
# Writes no lease holder could have made: an attempt newer than the run's, or an older
# attempt's message after a newer attempt's (a zombie writing after the reclaim).
_FENCED: Final = """
SELECT m.run_id, m.seq, m.attempt, 'message' AS what FROM runpool.messages m
JOIN runpool.runs r ON r.id = m.run_id
WHERE m.attempt > r.attempt OR m.attempt < (
    SELECT max(p.attempt) FROM runpool.messages p WHERE p.run_id = m.run_id AND p.seq < m.seq)
UNION ALL
SELECT c.run_id, NULL, c.attempt, 'tool call ' || c.call_id FROM runpool.tool_calls c
JOIN runpool.runs r ON r.id = c.run_id WHERE c.attempt > r.attempt
LIMIT 20"""
# Runs cancelled while running that took longer than the bound to end.
_CANCEL_LATENCY: Final = """
SELECT id, extract(epoch FROM finished_at - cancel_requested_at) AS seconds
FROM runpool.runs
WHERE status = 'cancelled' AND started_at IS NOT NULL
  AND finished_at - cancel_requested_at > make_interval(secs => %(bound)s)
ORDER BY seconds DESC LIMIT 20"""
# Durable waits (0013): a waiting run holds no lease and has exactly one pending wait; no
# finished run has one; a signal is consumed by one wait and a signalled wait consumed exactly
# one signal, whose payload it returned.
_WAITS: Final = """
SELECT 'waiting run ' || r.id || ' has a lease or ' || count(w.seq) || ' pending waits'
FROM runpool.runs r
LEFT JOIN runpool.waits w ON w.run_id = r.id AND w.state = 'pending'
WHERE r.status = 'waiting'
GROUP BY r.id, r.lease_expires_at HAVING r.lease_expires_at IS NOT NULL OR count(w.seq) <> 1
UNION ALL
SELECT r.status || ' run ' || r.id || ' still has pending wait ' || w.seq
FROM runpool.runs r JOIN runpool.waits w ON w.run_id = r.id AND w.state = 'pending'
WHERE r.status IN ('succeeded', 'failed', 'cancelled')
UNION ALL
SELECT 'wait ' || w.run_id || '/' || w.seq || ' (' || w.state || ') consumed '
       || count(s.id) || ' signals' || CASE WHEN bool_or(s.payload IS DISTINCT FROM w.payload)
                                            THEN ', not the payload it returned' ELSE '' END
FROM runpool.waits w
LEFT JOIN runpool.signals s ON s.run_id = w.run_id AND s.consumed_by = w.seq
GROUP BY w.run_id, w.seq, w.state, w.payload
HAVING count(s.id) <> CASE w.state WHEN 'signalled' THEN 1 ELSE 0 END
    OR bool_or(s.payload IS DISTINCT FROM w.payload)
LIMIT 20"""
# Counts by status.
_STATUSES: Final = "SELECT status, count(*) FROM runpool.runs GROUP BY status"
# Right now: tenants over their quota, serial keys with more than one live lease, and keys
# whose unfinished runs do not have exactly one head (two could run at once; none: stuck).
_OVER: Final = """
SELECT 'tenant ' || l.tenant || ' had ' || l.n || ' live leases, over its quota of ' || l.quota
FROM (SELECT r.tenant, count(*) AS n,
             coalesce(t.max_running, (SELECT default_quota FROM runpool.config)) AS quota
      FROM runpool.runs r LEFT JOIN runpool.tenants t USING (tenant)
      WHERE r.status = 'running' AND r.lease_expires_at > now()
      GROUP BY r.tenant, t.max_running) l
WHERE l.n > l.quota
UNION ALL
SELECT 'serial key ' || tenant || '/' || serial_key || ' had ' || count(*) || ' live leases'
FROM runpool.runs
WHERE status = 'running' AND lease_expires_at > now() AND serial_key IS NOT NULL
GROUP BY tenant, serial_key HAVING count(*) > 1
UNION ALL
SELECT 'serial key ' || tenant || '/' || serial_key || ' had '
       || count(*) FILTER (WHERE NOT held) || ' heads for ' || count(*) || ' unfinished runs'
FROM runpool.runs
WHERE status IN ('queued', 'running') AND serial_key IS NOT NULL
GROUP BY tenant, serial_key HAVING count(*) FILTER (WHERE NOT held) <> 1"""


@dataclass(frozen=True, slots=True)
class Report:
    statuses: dict[str, int]
    violations: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "statuses": self.statuses, "violations": list(self.violations)}


def record_execution(dsn: str, run_id: Any, call_id: str, attempt: int, key: str) -> None:
    """Record one real execution of a tool (call it from inside the tool)."""
    at = datetime.now(UTC)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_RECORD, (str(run_id), call_id, attempt, key, at))


def check(conn: psycopg.Connection[Any], *, cancel_bound: float | None = None,
          watch: Watch | None = None, all_terminal: bool = True) -> Report:
    """Check every invariant; `cancel_bound` is the longest a running run may take to end
    once cancelled (None: not checked); `watch` adds what it saw while the pool ran."""
    violations: list[str] = []
    if all_terminal:
        violations += [f"run {i} did not end: still {s}" for i, s in _rows(conn, _NOT_TERMINAL)]
    violations += [f"run {i} ({s}): {n} terminal events, attempts claimed in order {c}"
                   for i, s, n, c in _rows(conn, _EVENTS)]
    if _has_executions_table(conn):
        violations += [
            f"tool call {r}/{c} ({s} by attempt {a}) executed {later} time(s) from that attempt"
            f" on, {total} in all" for r, c, s, a, later, total in _rows(conn, _TOOL_TWICE)]
        violations += [
            f"tool call {r}/{c} ({s} by attempt {a}) was executed by attempt {e}, which ended"
            " alive without committing it (its result thrown away, the tool run again)"
            for r, c, s, a, e in _rows(conn, _RESULT_THROWN_AWAY)]
    violations += [f"run {r}: {what} (seq {q}) written by fenced attempt {a}"
                   for r, q, a, what in _rows(conn, _FENCED)]
    violations += [what for (what,) in _rows(conn, _WAITS)]
    if cancel_bound is not None:
        violations += [f"run {i} took {s:.1f}s to end after its cancel (bound {cancel_bound}s)"
                       for i, s in _rows(conn, _CANCEL_LATENCY, {"bound": cancel_bound})]
    if watch is not None:
        violations += watch.violations
    return Report(dict(_rows(conn, _STATUSES)), tuple(violations))


def _rows(conn: psycopg.Connection[Any], query: str,
          params: dict[str, Any] | None = None) -> list[Any]:
    return conn.execute(query, params).fetchall()


def _has_executions_table(conn: psycopg.Connection[Any]) -> bool:
    row = conn.execute("SELECT to_regclass('tool_log') IS NOT NULL").fetchone()
    return bool(row and row[0])


@dataclass
class Watch:
    """Samples live leases per tenant and per serial key on its own connection while a pool
    runs, recording every overshoot (each sample is one snapshot, so none is a false alarm)."""

    dsn: str
    interval: float = 0.02
    samples: int = 0
    violations: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Watch:
        self._thread = threading.Thread(target=self._sample, name="invariant-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _sample(self) -> None:
        try:
            with connect(self.dsn, autocommit=True) as conn:
                while not self._stop.wait(self.interval):
                    seen = [text for (text,) in conn.execute(_OVER).fetchall()]
                    self.samples += 1
                    self.violations += [v for v in seen if v not in self.violations]
        except Exception as exc:  # a watch that stopped looking must not pass as a clean one
            self.violations.append(f"the watch stopped after {self.samples} samples: {exc!r}")
