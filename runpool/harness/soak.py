"""`python -m runpool bench --soak MINUTES`: a pool under a random mix of faults, then the
invariant report.

A real pool (`python -m runpool`, two workers) runs agent-like handlers against a scratch
database through a TCP proxy, while the driver enqueues work and, at random, kills and
freezes workers, terminates their backends, cuts and black-holes their connections, cancels
runs, races idempotency keys, tries bad input, enqueues poison inputs for one tenant through
the SQL API, floods NOTIFY from a login with no privileges and kills the host's listener
process (its one LISTEN connection, relaying doorbells and cancel notices to the workers: at
least once a third of the way in, then at random); the supervisor must start a new one. The
database itself is set up as production databases often are: sessions idle for 3 s are closed
by the server, the default isolation is repeatable read, and every idle pool connection is
terminated now and then (a failover, a restart). Then it heals everything, waits
for every run to end and prints one JSON line: the faults injected and runpool.invariants'
report.
"""

from __future__ import annotations

import json
import os
import random
import time
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ..db import connect
from ..embedded import resolve_dsn
from ..settings import Settings
from ..testing.databases import scratch_database
from ..testing.hostile import unprivileged_login
from ..testing.invariants import EXECUTIONS_DDL, Watch, check
from ..testing.pools import running_pool
from ..testing.proxy import Proxy
from .soak_app import EXECUTIONS_DSN
from .soak_faults import DRIVER, LEASE, TENANT_QUOTAS, Soak

__all__ = ["run_soak"]

CANCEL_GRACE: Final = 2.0
POLL: Final = 0.5
CANCEL_BOUND: Final = 30.0
# The longest a running run took to end after its cancel.
SLOWEST_CANCEL: Final = """
SELECT max(extract(epoch FROM finished_at - cancel_requested_at)) FROM runpool.runs
WHERE status = 'cancelled' AND started_at IS NOT NULL"""
# Database defaults a pool must live with (new sessions get them): the server closes idle
# sessions, and transactions are repeatable read unless the session says otherwise.
DATABASE_DEFAULTS: Final = {"idle_session_timeout": "3s",
                            "default_transaction_isolation": "repeatable read"}
# Runs a pool failed for a handler it does not serve (a mixed fleet: must be none).
FOREIGN_FAILED: Final = """
SELECT count(*) FROM runpool.runs WHERE error->>'reason' = 'unknown_handler'"""


def run_soak(settings: Settings, minutes: float, *, seed: int | None = None,
             min_runs: int = 0) -> int:
    """Soak a pool for `minutes`, and on until the soak enqueued `min_runs` runs (a loaded
    machine does less in a minute; ten times `minutes` at the most); prints the report and
    returns 0 if every invariant held."""
    seed = random.randrange(1 << 30) if seed is None else seed
    rng = random.Random(seed)
    with scratch_database(resolve_dsn(settings)) as pool_dsn:
        # The driver's sessions keep no idle timeout: the faults are for the pool.
        dsn = make_conninfo(pool_dsn, application_name=DRIVER,
                            options="-c idle_session_timeout=0")
        with connect(dsn, autocommit=True) as conn:
            conn.execute(EXECUTIONS_DDL)
            for setting, value in DATABASE_DEFAULTS.items():
                conn.execute(sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                    sql.Identifier(conn.info.dbname), sql.Identifier(setting),
                    sql.Literal(value)))
            for tenant, quota in TENANT_QUOTAS.items():
                conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
        proxy = Proxy(pool_dsn)
        os.environ[EXECUTIONS_DSN] = dsn
        started = time.monotonic()
        try:
            with unprivileged_login(pool_dsn) as hostile, Watch(dsn) as watch, running_pool(
                    proxy.dsn(pool_dsn), "runpool.harness.soak_app:app", stop="drain",
                    output="discard", workers=2, concurrency=8,
                    lease_seconds=LEASE, poll_seconds=POLL, cancel_grace_seconds=CANCEL_GRACE,
                    grace_seconds=5) as pool, running_pool(
                    proxy.dsn(pool_dsn), "runpool.harness.soak_app:other_app", stop="drain",
                    output="discard", workers=1, concurrency=4,
                    lease_seconds=LEASE, poll_seconds=POLL, grace_seconds=5):
                # Named as the driver's, so the faults spare its connections too.
                hostile_dsn = make_conninfo(hostile, application_name=DRIVER)
                soak = Soak(dsn, proxy, pool, rng, hostile_dsn)
                listener_killed = False
                try:
                    while _faulting(time.monotonic() - started, minutes * 60,
                                    soak.faults["runs_enqueued"] < min_runs):
                        if not listener_killed and time.monotonic() - started > minutes * 20:
                            soak.kill_listener()  # at least once, under load
                            listener_killed = True
                        soak.tick()
                        time.sleep(rng.uniform(0.1, 0.5))
                finally:
                    soak.heal()
                drain_timeout = 240 + 60 * minutes
                drained = _drain(soak.conn, timeout=drain_timeout)
                soak.check_poison()
                if not soak.listener_restarted():
                    soak.problems.append("the pool has no listener process after the soak:"
                                         " the supervisor did not restart a killed one")
                soak.conn.close()
        finally:
            proxy.close()
        with connect(dsn, autocommit=True) as conn:
            # A live worker ends a cancelled run within a heartbeat plus the grace; here every
            # worker may be dead or frozen for a while, so the bound is a generous one.
            report = check(conn, watch=watch, cancel_bound=CANCEL_BOUND)
            slowest = conn.execute(SLOWEST_CANCEL).fetchone()
            foreign = conn.execute(FOREIGN_FAILED).fetchone()
    violations = [*soak.problems, *report.violations]
    if foreign and foreign[0]:
        violations.append(f"{foreign[0]} runs failed as unknown to a pool of the mixed fleet")
    if not drained:
        violations.append(f"runs still not ended {drain_timeout:g} s after the faults stopped")
    print(json.dumps({
        "workload": "soak", "minutes": minutes, "seed": seed, "ok": not violations,
        "faults": dict(sorted(soak.faults.items())), "statuses": report.statuses,
        "watch_samples": watch.samples, "violations": violations,
        "slowest_cancel_seconds": round(float(slowest[0] or 0), 2) if slowest else None,
        "seconds": round(time.monotonic() - started, 1),
    }), flush=True)
    return 0 if not violations else 1


def _faulting(elapsed: float, seconds: float, short_of_runs: bool) -> bool:
    """Whether the faults go on: for `seconds`, then while the soak is short of runs, for
    ten times `seconds` at the most."""
    return elapsed < seconds or (short_of_runs and elapsed < 10 * seconds)


def _drain(conn: psycopg.Connection[Any], *, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute("SELECT count(*) FROM runpool.runs"
                           " WHERE status IN ('queued', 'running')").fetchone()
        if row and row[0] == 0:
            return True
        time.sleep(0.2)
    return False
