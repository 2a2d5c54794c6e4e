"""The soak's fault injector: one random batch of work or fault per tick (kills and freezes
workers, terminates backends, cuts and black-holes connections, cancels runs, races
idempotency keys, tries bad and poison input, floods NOTIFY, holds callers' transactions
open, kills the listener), the problems it saw on the way, and `heal` to undo what lasts."""

from __future__ import annotations

import os
import random
import signal
import threading
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, Final

import psycopg

from ..db import connect
from ..enqueue import RunSpec, enqueue, enqueue_many
from ..errors import InvalidInput
from ..testing.hostile import POISON_INPUTS, enqueue_raw, notify_flood
from ..testing.pools import listener_pid, wait_for, worker_pids
from ..testing.proxy import Proxy

__all__ = ["DRIVER", "LEASE", "TENANT_QUOTAS", "Soak"]

# The driver's own connections (the faults spare them).
DRIVER: Final = "runpool-soak-driver"
# The pool's lease: freezes and black holes last up to 1.5 of it, so some outlive it.
LEASE: Final = 2.0
TENANT_QUOTAS: Final = {"t0": 2, "t1": 3, "t2": 4}
SERIAL_KEYS: Final = [f"k{i}" for i in range(8)]
# The tenant whose inputs are poison (valid jsonb the worker's decoder refuses).
POISON_TENANT: Final = "tp"
# How the poison-input runs ended: each must fail alone (invalid_input) or be cancelled.
POISON_ENDINGS: Final = """
SELECT id, status, error ->> 'reason' FROM runpool.runs WHERE id = ANY(%s)
  AND NOT (status = 'cancelled' OR (status = 'failed' AND error ->> 'reason' = 'invalid_input'))
"""
# Every idle pool connection (workers name theirs runpool-<pid>; the driver's are spared),
# terminated at once.
TERMINATE_IDLE: Final = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'runpool-%%'
  AND application_name <> %s AND state = 'idle'"""


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
    """One random batch of work or fault per tick, against one pool (run_soak drives it)."""

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
