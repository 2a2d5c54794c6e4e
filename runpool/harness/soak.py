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

import asyncio
import json
import os
import random
import signal
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from ..app import App
from ..context import Run
from ..db import connect
from ..embedded import resolve_dsn
from ..enqueue import RunSpec, enqueue, enqueue_many
from ..errors import InvalidInput, ToolOutcomeUnknown
from ..settings import Settings
from ..testing.databases import scratch_database
from ..testing.hostile import POISON_INPUTS, enqueue_raw, notify_flood, unprivileged_login
from ..testing.invariants import EXECUTIONS_DDL, Watch, check, record_execution
from ..testing.pools import listener_pid, running_pool, wait_for, worker_pids
from ..testing.proxy import Proxy

__all__ = ["app", "other_app", "run_soak"]

app = App()
# A second application with a pool of its own (a mixed fleet): `app`'s pool must leave its
# runs alone, and they must all be run by this one.
other_app = App()

# Where tools record their executions: the database itself, not through the proxy, so the
# evidence survives the faults the soak injects.
EXECUTIONS_DSN: Final = "RUNPOOL_SOAK_EXECUTIONS_DSN"
# The driver's own connections (the faults spare them).
DRIVER: Final = "runpool-soak-driver"
LEASE: Final = 2.0
CANCEL_GRACE: Final = 2.0
POLL: Final = 0.5
TENANT_QUOTAS: Final = {"t0": 2, "t1": 3, "t2": 4}
SERIAL_KEYS: Final = [f"k{i}" for i in range(8)]
CANCEL_BOUND: Final = 30.0
# The longest a running run took to end after its cancel.
# The tenant whose inputs are poison (valid jsonb the worker's decoder refuses).
POISON_TENANT: Final = "tp"
# How the poison-input runs ended: each must fail alone (invalid_input) or be cancelled.
POISON_ENDINGS: Final = """
SELECT id, status, error ->> 'reason' FROM runpool.runs WHERE id = ANY(%s)
  AND NOT (status = 'cancelled' OR (status = 'failed' AND error ->> 'reason' = 'invalid_input'))
"""
SLOWEST_CANCEL: Final = """
SELECT max(extract(epoch FROM finished_at - cancel_requested_at)) FROM runpool.runs
WHERE status = 'cancelled' AND started_at IS NOT NULL"""
# Database defaults a pool must live with (new sessions get them): the server closes idle
# sessions, and transactions are repeatable read unless the session says otherwise.
DATABASE_DEFAULTS: Final = {"idle_session_timeout": "3s",
                            "default_transaction_isolation": "repeatable read"}
# Every idle pool connection (workers name theirs runpool-<pid>; the driver's are spared),
# terminated at once.
TERMINATE_IDLE: Final = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'runpool-%%'
  AND application_name <> %s AND state = 'idle'"""
# Runs a pool failed for a handler it does not serve (a mixed fleet: must be none).
FOREIGN_FAILED: Final = """
SELECT count(*) FROM runpool.runs WHERE error->>'reason' = 'unknown_handler'"""


@app.handler("agent")
async def agent(run: Run) -> Any:
    """Model turns and tool calls, checkpointed; `unsafe` tools are never retried blindly."""
    steps = int(run.input.get("steps", 3))
    unsafe = bool(run.input.get("unsafe", False))
    for i in range(steps):
        if sum(m.role == "assistant" for m in run.messages) <= i:
            await run.add_message("assistant", {"turn": i})
        try:
            await run.tool(f"c{i}", "act", {"i": i}, _act(run), retry_interrupted=not unsafe)
        except ToolOutcomeUnknown:
            await run.add_message("user", {"unknown": f"c{i}"})
    return {"steps": steps, "attempt": run.attempt}


def _act(run: Run) -> Callable[[Any, str], Any]:
    async def act(arguments: Any, key: str) -> Any:
        await asyncio.to_thread(record_execution, os.environ[EXECUTIONS_DSN], run.id,
                                f"c{arguments['i']}", run.attempt, key)
        await asyncio.sleep(float(run.input.get("tool_seconds", 0.05)))
        return {"done": arguments["i"]}
    return act


@app.handler("plain")
def plain(run: Run) -> Any:
    """A plain def (run in a thread): checkpointed calls of a plain tool (a thread of its own)
    through tool_sync, which refuses new calls after a cancel; a cleanup message if cancelled."""
    steps = int(run.input.get("steps", 3))
    for i in range(steps):
        if run.cancelled:
            run.add_message_sync("system", {"cancelled_before": i})
            return None
        run.tool_sync(f"c{i}", "act", {"i": i}, _act_plain(run))
    return {"steps": steps, "attempt": run.attempt}


def _act_plain(run: Run) -> Callable[[Any, str], Any]:
    def act(arguments: Any, key: str) -> Any:
        record_execution(os.environ[EXECUTIONS_DSN], run.id, f"c{arguments['i']}", run.attempt,
                         key)
        time.sleep(float(run.input.get("tool_seconds", 0.05)))
        return {"done": arguments["i"]}
    return act


@app.handler("hold")
async def hold(run: Run) -> Any:
    """Waits to be cancelled (for at most `seconds`)."""
    await asyncio.sleep(float(run.input.get("seconds", 8)))
    return None


@app.handler("flaky")
async def flaky(run: Run) -> Any:
    if run.attempt == 1:
        raise RuntimeError("fails on its first attempt")
    return None


@other_app.handler("other")
async def other(run: Run) -> Any:
    await asyncio.sleep(0.05)
    return {"attempt": run.attempt}


@app.handler("poison")
async def poison(run: Run) -> Any:
    """Kills its worker on every attempt: must end failed without hurting anyone else."""
    os._exit(3)


def _random_run(rng: random.Random) -> dict[str, Any]:
    # Poison is rare (one run in ~500): each kills its worker on both of its attempts.
    kind = rng.choices(["agent", "plain", "hold", "flaky", "poison", "unknown"],
                       [16, 4, 3, 2, 0.05, 0.3])[0]
    spec: dict[str, Any] = {
        # Most work goes to the unlimited tenant: the quota-bound ones get what they can drain.
        "tenant": rng.choices([*TENANT_QUOTAS, "t3"], [1, 1.5, 2, 10])[0], "handler": kind,
        "priority": rng.randint(-5, 5), "max_attempts": 2 if kind == "poison" else 10,
        "serial_key": rng.choice(SERIAL_KEYS) if rng.random() < 0.3 else None,
        "input": {},
    }
    if kind == "agent":
        spec["input"] = {"steps": rng.randint(1, 6), "unsafe": rng.random() < 0.2,
                         "tool_seconds": rng.choice([0.01, 0.05, 0.2])}
    elif kind == "plain":
        spec["input"] = {"steps": rng.randint(1, 4), "tool_seconds": rng.choice([0.01, 0.1, 0.3])}
    elif kind == "unknown":
        spec["handler"] = "other"  # only other_app's pool serves it
    return spec


class Soak:
    """The driver: one random fault or batch of work per tick."""

    def __init__(self, dsn: str, proxy: Proxy, pool: Any, rng: random.Random,
                 hostile_dsn: str) -> None:
        self.dsn, self.proxy, self.pool, self.rng = dsn, proxy, pool, rng
        # A login with no privileges: it can only connect and NOTIFY.
        self.hostile_dsn = hostile_dsn
        self.poison: list[uuid.UUID] = []
        self.conn = connect(dsn, autocommit=True)
        self.faults: Counter[str] = Counter()
        self.problems: list[str] = []
        self._timers: list[threading.Timer] = []
        # Transactions a caller holds open (api_session), and what counting runs must not
        # interleave with (bad_input checks that a refusal wrote nothing).
        self._held: list[psycopg.Connection[Any]] = []
        self._counting = threading.Lock()
        self._killed_listeners: set[int] = set()

    def tick(self) -> None:
        actions: dict[Callable[[], None], float] = {
            self.enqueue_batch: 6, self.cancel_one: 2, self.kill_worker: 0.6,
            self.freeze_worker: 0.4, self.terminate_backend: 0.8, self.terminate_idle: 0.6,
            self.cut: 0.5,
            self.blackhole: 0.3, self.race_idempotency: 0.7, self.bad_input: 1,
            self.poison_input: 0.5, self.notify_flood: 0.3, self.api_session: 0.8,
            self.kill_listener: 0.3,
        }
        action = self.rng.choices(list(actions), list(actions.values()))[0]
        action()

    # -- work -------------------------------------------------------------------------------

    def enqueue_batch(self) -> None:
        specs = [RunSpec(**_random_run(self.rng))
                 for _ in range(self.rng.randint(3, 12))]
        try:
            enqueue_many(self.conn, specs)
        except psycopg.errors.DeadlockDetected:
            # Several serial keys in one transaction lock in list order; a worker's batch
            # locks the keys it ends in key order. PostgreSQL breaks the tie; callers retry.
            self.faults["enqueue_deadlock_retried"] += 1
            enqueue_many(self.conn, specs)
        self.faults["runs_enqueued"] += len(specs)

    def cancel_one(self) -> None:
        row = self.conn.execute(
            "SELECT id FROM runpool.runs WHERE status IN ('queued', 'running')"
            " ORDER BY random() LIMIT 1").fetchone()
        if row:
            self.conn.execute("SELECT runpool.cancel_run(%s, 'soak')", (row[0],))
            self.faults["cancel"] += 1

    def race_idempotency(self) -> None:
        key = f"dup-{uuid.uuid4().hex[:8]}"
        ids: list[uuid.UUID] = []

        def one() -> None:
            with connect(self.dsn, autocommit=True) as c:
                ids.append(enqueue(c, "t3", "agent", {"steps": 1},
                                              idempotency_key=key))

        threads = [threading.Thread(target=one) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(set(ids)) != 1 or len(ids) != 8:
            self.problems.append(f"idempotency key {key}: 8 racing enqueues gave ids {ids}")
        self.faults["idempotency_race"] += 1

    def bad_input(self) -> None:
        """Each must be refused with InvalidInput, writing nothing."""
        attempts: list[tuple[str, Callable[[], Any]]] = [
            ("nul_in_tenant", lambda: enqueue(self.conn, "t\x00", "agent")),
            ("lone_surrogate", lambda: enqueue(self.conn, "t3", "agent",
                                                          {"x": "\ud800"})),
            ("oversized_input", lambda: enqueue(self.conn, "t3", "agent",
                                                           {"x": "y" * (2 << 20)})),
            ("priority_range", lambda: enqueue(self.conn, "t3", "agent",
                                                          priority=1000)),
            ("empty_serial_key", lambda: enqueue(self.conn, "t3", "agent",
                                                            serial_key="")),
        ]
        name, attempt = self.rng.choice(attempts)
        with self._counting:
            before = self._count()
            try:
                attempt()
                self.problems.append(f"bad input {name} was accepted")
            except InvalidInput:
                pass
            if self._count() != before:
                self.problems.append(f"bad input {name} wrote a run")
        # Injection attempts are data: a run for a strange tenant, and a NULL answer.
        self.conn.execute("SELECT runpool.cancel_run(gen_random_uuid(),"
                          " $$'); DROP TABLE runpool.runs; --$$)")
        self.faults[f"bad_input_{name}"] += 1

    def poison_input(self) -> None:
        """A tenant's input jsonb holds but the decoder refuses, through the SQL API (no
        Python check in the way): it must fail alone, costing no worker and no neighbour."""
        self.poison.append(enqueue_raw(self.conn, POISON_TENANT, self.rng.choice(POISON_INPUTS),
                                       handler="agent", max_attempts=3))
        self.faults["poison_input"] += 1

    def notify_flood(self) -> None:
        """Forged notices from a bare login: random and real run ids on the cancel channel,
        malformed ones, and a burst of doorbells."""
        running = [r for (r,) in self.conn.execute(
            "SELECT id FROM runpool.runs WHERE status = 'running' LIMIT 5")]
        notify_flood(self.hostile_dsn, cancels=self.rng.randint(1_000, 20_000), noise=500,
                     named=running, named_each=50, wakeups=200)
        self.faults["notify_flood"] += 1

    def check_poison(self) -> None:
        for run_id, status, reason in self.conn.execute(POISON_ENDINGS, (self.poison,)):
            self.problems.append(f"poison-input run {run_id} ended {status} ({reason}),"
                                 " not failed alone with invalid_input")

    def _count(self) -> int:
        row = self.conn.execute("SELECT count(*) FROM runpool.runs").fetchone()
        return int(row[0]) if row else 0

    # -- faults -----------------------------------------------------------------------------

    def api_session(self) -> None:
        """A caller's transaction left open for up to 1.5 leases after a cancel of a running
        run (which locks its row), a cancel refused for another tenant, or a serial-key
        enqueue (which holds its key's lock): no worker may stall or lose work for it."""
        kind = self.rng.choice(["cancel", "refused_cancel", "serial_enqueue"])
        conn = connect(self.dsn)
        try:
            if kind == "serial_enqueue":
                enqueue(conn, "t3", "agent", {"steps": 1},
                        serial_key=self.rng.choice(SERIAL_KEYS))
            else:
                row = conn.execute("SELECT id, tenant FROM runpool.runs WHERE status = 'running'"
                                   " ORDER BY random() LIMIT 1").fetchone()
                if row is None:
                    conn.close()
                    return
                tenant = row[1] if kind == "cancel" else "intruder"
                answer = conn.execute("SELECT runpool.cancel_run(%s, 'held open', %s)",
                                      (row[0], tenant)).fetchone()
                if kind == "refused_cancel" and answer != (None,):
                    self.problems.append(f"a cancel for another tenant answered {answer}")
        except psycopg.Error:
            conn.close()
            return
        self._held.append(conn)
        timer = threading.Timer(self.rng.uniform(0.2, LEASE * 1.5), self._release_held, (conn,))
        timer.start()
        self._timers.append(timer)
        self.faults[f"api_session_{kind}_held"] += 1

    def _release_held(self, conn: psycopg.Connection[Any]) -> None:
        with self._counting:
            try:
                conn.commit()
            except psycopg.Error:
                pass
            conn.close()

    def workers(self) -> list[int]:
        return worker_pids(self.pool.pid)

    def kill_worker(self) -> None:
        if pids := self.workers():
            os.kill(self.rng.choice(pids), signal.SIGKILL)
            self.faults["worker_sigkill"] += 1

    def kill_listener(self) -> None:
        """SIGKILL the host's listener process mid-load: doorbells and cancel notices rung
        until the supervisor's new one listens are lost, and must cost no more than a poll
        (the new one tells every worker to claim once) or a heartbeat (cancels)."""
        if (pid := listener_pid(self.pool.pid)) is not None:
            os.kill(pid, signal.SIGKILL)
            self.faults["listener_sigkill"] += 1
            self._killed_listeners.add(pid)

    def listener_restarted(self) -> bool:
        """Whether the pool has a listener, none of those this soak killed, within the
        supervisor's longest restart backoff (30 s: killed again and again, it backs off)."""
        def restarted() -> bool:
            pid = listener_pid(self.pool.pid)
            return pid is not None and pid not in self._killed_listeners

        try:
            wait_for(restarted, 40, what="a new listener process")
        except AssertionError:
            return False
        return True

    def freeze_worker(self) -> None:
        """SIGSTOP past the lease, then SIGCONT: a zombie that must write nothing."""
        if pids := self.workers():
            pid = self.rng.choice(pids)
            os.kill(pid, signal.SIGSTOP)
            timer = threading.Timer(LEASE * 1.5, _resume, (pid,))
            timer.start()
            self._timers.append(timer)
            self.faults["worker_sigstop"] += 1

    def terminate_backend(self) -> None:
        self.conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname ="
            " current_database() AND application_name <> %s AND backend_type = 'client backend'"
            " ORDER BY random() LIMIT 1", (DRIVER,))
        self.faults["pg_terminate_backend"] += 1

    def terminate_idle(self) -> None:
        """Every idle pool connection at once, as a failover or a restart does."""
        row = self.conn.execute(TERMINATE_IDLE, (DRIVER,)).fetchone()
        self.faults["idle_pool_connections_terminated"] += int(row[0]) if row else 0

    def cut(self) -> None:
        self.proxy.cut()
        self.faults["connections_cut"] += 1

    def blackhole(self) -> None:
        self.proxy.blackholed.set()
        timer = threading.Timer(self.rng.uniform(0.5, LEASE * 1.5), self.proxy.blackholed.clear)
        timer.start()
        self._timers.append(timer)
        self.faults["blackhole"] += 1

    def heal(self) -> None:
        for timer in self._timers:
            timer.cancel()
        self.proxy.blackholed.clear()
        for pid in self.workers():
            _resume(pid)
        for conn in self._held:
            if not conn.closed:
                self._release_held(conn)


def _resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


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
                    proxy.dsn(pool_dsn), "runpool.harness.soak:app", stop="drain", output="discard",
                    workers=2, concurrency=8,
                    lease_seconds=LEASE, poll_seconds=POLL, cancel_grace_seconds=CANCEL_GRACE,
                    grace_seconds=5) as pool, running_pool(
                    proxy.dsn(pool_dsn), "runpool.harness.soak:other_app", stop="drain",
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
