"""A host cut off from the database while its processes live on (issue 19): two hosts as
network namespaces, each a real pool; one is cut mid-run, the other reclaims its runs once
their leases expire, the partition heals, and every invariant holds (no committed tool call
run again, no write from a cut-off attempt, the tenant's quota never exceeded across hosts).
Needs root (ip netns); skips without it unless RUNPOOL_TEST_REQUIRE_SYSTEM=1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg

import runpool
from runpool.db import connect
from runpool.testing import Watch, with_database, worker_pids
from tests.clusters import Host, cluster, migrated_database, netns_hosts
from tests.helpers import ROOT, assert_invariants, pool_env, scalar, wait_for

LEASE = 6.0
# Running runs by worker.
RUNNING = "SELECT id, worker_id FROM runpool.runs WHERE status = 'running'"


@contextmanager
def _pool_on(host: Host, dsn: str, **settings: Any) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m runpool worker` inside the host's namespace (ip netns exec execs it: the
    supervisor keeps the pid the test sees)."""
    log = tempfile.NamedTemporaryFile(prefix="runpool-host-", suffix=".log", delete=False)
    proc = subprocess.Popen(host.command([sys.executable, "-m", "runpool", "worker"]),
                            env={**pool_env(dsn, **settings), "RUNPOOL_APP": "tests.apps:app"},
                            cwd=ROOT, start_new_session=True, stdout=log,
                            stderr=subprocess.STDOUT)
    try:
        yield proc
    except BaseException:
        sys.stderr.write(Path(log.name).read_text(errors="replace")[-4000:])
        raise
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        log.close()
        Path(log.name).unlink(missing_ok=True)


def _worker_ids(conn: psycopg.Connection[Any], supervisor: int) -> set[Any]:
    pids = worker_pids(supervisor)
    return {w for (w,) in conn.execute(
        "SELECT id FROM runpool.workers WHERE pid = ANY(%s) AND stopped_at IS NULL", (pids,))}


def test_partition__a_cut_off_hosts_runs_are_reclaimed_elsewhere_and_invariants_hold() -> None:
    with netns_hosts(2) as (a, b), \
            cluster(addresses=("127.0.0.1", a.server_address, b.server_address)) as node:
        dsn = migrated_database(node.dsn())
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        dsn_a = with_database(node.dsn(host=a.server_address), str(dbname))
        dsn_b = with_database(node.dsn(host=b.server_address), str(dbname))
        settings = {"workers": 1, "concurrency": 4, "lease_seconds": LEASE, "poll_seconds": 1,
                    "grace_seconds": 2}
        with connect(dsn, autocommit=True) as conn, Watch(dsn) as watch:
            conn.execute("SELECT runpool.set_tenant_quota('acme', 3)")
            ids = runpool.enqueue_many(conn, [
                runpool.RunSpec("acme" if i % 2 else "beta", "agent",
                                {"steps": 4, "tool_seconds": 0.5}) for i in range(16)])
            with _pool_on(a, dsn_a, **settings) as pool_a, _pool_on(b, dsn_b, **settings):
                wait_for(lambda: len(_worker_ids(conn, pool_a.pid)) == 1, timeout=30,
                         what="host a's worker")
                mine = _worker_ids(conn, pool_a.pid)
                held = wait_for(lambda: [r for r, w in conn.execute(RUNNING) if w in mine],
                                timeout=30, what="host a running runs")
                a.cut()
                try:
                    # Host b takes host a's runs over once their leases have run out.
                    wait_for(lambda: not [r for r, w in conn.execute(RUNNING) if w in mine],
                             timeout=4 * LEASE + 10, what="host a's runs reclaimed")
                    assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                                        " AND attempt > 1", held) >= 1
                    # Host a's processes lived through the cut.
                    assert pool_a.poll() is None and worker_pids(pool_a.pid)
                finally:
                    a.heal()
                wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs WHERE"
                                              " id = ANY(%s) AND status IN ('succeeded',"
                                              " 'failed', 'cancelled')", ids) == 16,
                         timeout=90, what="every run ended")
            assert scalar(conn, "SELECT count(*) FROM runpool.runs WHERE id = ANY(%s)"
                                " AND status = 'succeeded'", ids) == 16
            assert watch.samples > 10
            assert_invariants(conn, watch=watch)


def _lines(proc: subprocess.Popen[str], seen: list[str]) -> Callable[[], list[str]]:
    """What the probe printed so far (read by a thread: a pipe read would block)."""
    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return lambda: list(seen)


def test_listen_connection_black_holed__noticed_within_seconds_then_rejoined() -> None:
    # The LISTEN connection sits idle by design, and a silent path raises nothing on an idle
    # socket: only keepalives notice. At the pooled connections' pace (10 s idle, then
    # tcp_user_timeout's 30 s) the host's wake-ups fell back to the poll for ~31 s; the
    # LISTEN connection's own (db.LISTEN_KEEPALIVES: 4 s idle, 10 s) notice within ~10 s.
    with netns_hosts(1) as (host,), \
            cluster(addresses=("127.0.0.1", host.server_address)) as node:
        dsn = migrated_database(node.dsn())
        dbname = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        there = with_database(node.dsn(host=host.server_address), str(dbname))
        seen: list[str] = []
        probe = subprocess.Popen(host.command([sys.executable, "-m", "tests.listen_probe", there]),
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 text=True, start_new_session=True)
        try:
            lines = _lines(probe, seen)
            with connect(dsn, autocommit=True) as conn:
                wait_for(lambda: "connected" in lines(), timeout=30, what="the probe listening")
                conn.execute("NOTIFY runpool_wakeup")
                wait_for(lambda: "wake" in lines(), timeout=10, what="a doorbell heard")
                host.cut()
                try:
                    # Bounded well below the old keepalives' ~31 s, with room for a slow
                    # machine.
                    wait_for(lambda: "lost" in lines(), timeout=18, what="the cut noticed")
                finally:
                    host.heal()
                wait_for(lambda: lines().count("connected") == 2, timeout=30,
                         what="listening again")
                conn.execute("NOTIFY runpool_wakeup")
                wait_for(lambda: lines().count("wake") == 2, timeout=10,
                         what="a doorbell heard after the rejoin")
        finally:
            os.killpg(probe.pid, signal.SIGKILL)
            probe.wait(timeout=10)
