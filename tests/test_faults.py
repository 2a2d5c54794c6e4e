"""Network faults between workers and the database, through a real TCP proxy."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

import runpool
from runpool import db
from runpool.db import aconnect, connect
from runpool.deadlines import bounded
from runpool.migrate import migrate
from runpool.pools import open_pool
from runpool.testing import Proxy
from tests.helpers import (
    LISTENING,
    assert_invariants,
    events,
    live_workers,
    pid_alive,
    run_row,
    running_pool,
    scalar,
    wait_for,
)


@pytest.fixture
def proxy(server_dsn: str) -> Iterator[Proxy]:
    p = Proxy(server_dsn)
    yield p
    p.close()


def test_blackholed_database__worker_gives_up_its_lease_and_recovers_after_healing(
        conn: psycopg.Connection, dsn: str, proxy: Proxy) -> None:
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 6})
    with running_pool(proxy.dsn(dsn), lease_seconds=3, poll_seconds=1) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="claim")
        # A heartbeat renewed the lease: the worker surely holds the run in a slot (a claim
        # whose answer is lost on the way back is simply recovered by the lease expiring).
        first_lease = run_row(conn, run_id)["lease_expires_at"]
        wait_for(lambda: run_row(conn, run_id)["lease_expires_at"] > first_lease,
                 what="a heartbeat")
        # Silence: every byte between the worker and the database vanishes, nothing errors.
        proxy.blackholed.set()
        # The heartbeat cannot finish, so before the lease can have expired in the database
        # the worker abandons the run instead of hanging on the dead connection.
        wait_for(lambda: "action=lease_lost" in pool.log(), timeout=15, what="lease given up")
        proxy.blackholed.clear()
        # New connections work again: the run is reclaimed and finished by a fresh attempt.
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=40,
                 what="run finished after healing")
        row = run_row(conn, run_id)
        assert row["attempt"] == 2 and row["result"]["attempt"] == 2
        assert events(conn, run_id) == ["enqueued", "claimed", "reclaimed", "claimed", "succeeded"]
    assert_invariants(conn)


def test_keepalives__the_listen_connection_probes_sooner_and_a_dsns_own_settings_win(
        dsn: str) -> None:
    """Every connection gets runpool's keepalives and the LISTEN connection its faster ones
    (db.LISTEN_KEEPALIVES); an operator's DSN that sets its own (a flaky path, relaxed) wins,
    but not over client_encoding UTF8 (runpool's JSON is UTF-8)."""
    def params(conn: Any) -> dict[str, str | None]:
        got = conn.info.get_parameters()
        return {k: got.get(k) for k in ("keepalives_idle", "keepalives_interval",
                                        "keepalives_count", "tcp_user_timeout")}

    async def listening(target: str) -> tuple[dict[str, str | None], str | None]:
        async with await aconnect(target, autocommit=True, listen=True) as conn:
            return params(conn), conn.info.parameter_status("client_encoding")

    with connect(dsn) as conn:
        assert params(conn) == {"keepalives_idle": "10", "keepalives_interval": "3",
                                "keepalives_count": "3", "tcp_user_timeout": "30000"}
    assert asyncio.run(listening(dsn)) == ({"keepalives_idle": "4", "keepalives_interval": "2",
                                            "keepalives_count": "3",
                                            "tcp_user_timeout": "10000"}, "UTF8")
    # A DSN that tunes one of them tunes them all (libpq's defaults for the rest): runpool's
    # 10 s tcp_user_timeout beside a 60 s idle would abort at the first unanswered probe.
    relaxed = dsn + " keepalives_idle=60 client_encoding=LATIN1"
    assert asyncio.run(listening(relaxed)) == ({"keepalives_idle": "60",
                                                "keepalives_interval": None,
                                                "keepalives_count": None,
                                                "tcp_user_timeout": None}, "UTF8")


def test_blackholed_connect__gives_up_at_the_default_connect_timeout(
        dsn: str, proxy: Proxy, monkeypatch: pytest.MonkeyPatch) -> None:
    """A connection attempt started while the network is silent (a listener's reconnect, a
    pool's) gives up at runpool's connect timeout, not psycopg's 130 s; a DSN's own wins."""
    monkeypatch.setattr(db, "CONNECT_TIMEOUT", 2, raising=False)  # 10 s normally

    async def attempt(target: str) -> float:
        started = time.monotonic()
        with pytest.raises(psycopg.OperationalError):
            await asyncio.wait_for(aconnect(target), 20)
        return time.monotonic() - started

    proxy.blackholed.set()
    assert asyncio.run(attempt(proxy.dsn(dsn))) < 6
    assert asyncio.run(attempt(proxy.dsn(dsn) + " connect_timeout=3")) >= 2.9
    proxy.blackholed.clear()
    with connect(proxy.dsn(dsn)) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)


def test_blackholed_statement__fails_at_its_deadline_and_the_connection_is_replaced(
        dsn: str, proxy: Proxy) -> None:
    """The CI failure behind `bounded`: a cancelled statement on a silent path made psycopg
    send a cancel request and wait for it (up to ten seconds), outliving the lease."""

    async def scenario() -> tuple[float, Any]:
        # One connection: the second use must get a replacement for the cut one.
        pool = await open_pool(proxy.dsn(dsn), size=1, name="blackhole-test")
        try:
            proxy.blackholed.set()
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                async with bounded(pool, 1.0) as conn:
                    await conn.execute("SELECT 1")
            elapsed = time.monotonic() - started
            proxy.blackholed.clear()
            async with bounded(pool, 5.0) as conn:
                cur = await conn.execute("SELECT 1")
                return elapsed, await cur.fetchone()
        finally:
            await pool.close()

    elapsed, row = asyncio.run(scenario())
    # The deadline holds to within scheduling noise, nowhere near psycopg's ten seconds.
    assert elapsed < 4, elapsed
    assert row == (1,)


def test_slow_server_past_the_deadline__the_server_stops_the_statement_too(
        conn: psycopg.Connection, dsn: str) -> None:
    """A reachable but slow server: the caller gives up at the deadline, and the server must
    not go on running (and holding the locks of) the work it gave up on."""
    conn.execute("CREATE TABLE late (x int)")

    async def scenario() -> None:
        pool = await open_pool(dsn, size=1, name="slow-test")
        try:
            with pytest.raises(TimeoutError):
                async with bounded(pool, 1.0) as c, c.pipeline(), c.transaction():
                    await c.execute("INSERT INTO late VALUES (1)")
                    await c.execute("SELECT pg_sleep(60)")
            # The cancel request travels in the background: the loop must keep running.
            # Cancelled, the backend is gone in well under a second; left alone, it would
            # sleep its full minute.
            await asyncio.to_thread(
                wait_for, lambda: not scalar(
                    conn, "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                    " current_database() AND query = 'SELECT pg_sleep(60)' AND state <> 'idle'"),
                timeout=15, what="the abandoned statement stopped by the server")
        finally:
            await pool.close()

    asyncio.run(scenario())
    assert scalar(conn, "SELECT count(*) FROM late") == 0


def test_connections_cut__worker_reconnects_and_the_run_finishes(
        conn: psycopg.Connection, dsn: str, proxy: Proxy) -> None:
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 1})
    with running_pool(proxy.dsn(dsn), lease_seconds=3) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="claim")
        # The LISTEN connection too, once it is up: a claim planned ahead (runpool.warmup)
        # can take the run before the listener has connected (CI: the cut then met its
        # connect, listen_connect_failed, and nothing was lost to reconnect from).
        wait_for(lambda: conn.execute(LISTENING).fetchone() == (1,), what="the LISTEN")
        proxy.cut()  # every connection, the LISTEN one included, dies mid-flight
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=40,
                 what="run finished")
        after = runpool.enqueue(conn, "acme", "noop")
        wait_for(lambda: run_row(conn, after)["status"] == "succeeded", timeout=20,
                 what="worker alive after reconnecting")
        assert "action=listen_lost" in pool.log()
    assert_invariants(conn)


def test_poison_run__fails_after_its_attempts_and_the_pool_recovers(
        conn: psycopg.Connection, dsn: str) -> None:
    poison = runpool.enqueue(conn, "evil", "poison", max_attempts=3)
    with running_pool(dsn, workers=2, lease_seconds=1) as pool:
        wait_for(lambda: run_row(conn, poison)["status"] == "failed", timeout=60,
                 what="poison run failed")
        # The supervisor restarted each crashed worker after a backoff, not in a spin.
        assert pool.log().count("action=worker_exited") == 3
        after = [runpool.enqueue(conn, "good", "noop") for _ in range(10)]
        wait_for(lambda: all(run_row(conn, r)["status"] == "succeeded" for r in after),
                 timeout=30, what="the pool working again")
    row = run_row(conn, poison)
    assert (row["attempt"], row["error"]["reason"]) == (3, "lease_expired")
    assert events(conn, poison).count("reclaimed") == 2
    assert_invariants(conn)


@pytest.fixture
def private_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A PostgreSQL of this test's own (pgserver), so the test may crash and restart it."""
    import pgserver

    data = tmp_path_factory.mktemp("private-pg")
    data.chmod(0o777)  # pgserver runs postgres as its own system user when we are root
    server = pgserver.get_server(data, cleanup_mode="stop")  # type: ignore[attr-defined]
    yield server
    # Stopped by hand: after a restart pgserver's own cleanup no longer knows the postmaster.
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    try:
        pg_ctl(["-w", "-m", "fast", "stop"], pgdata=server.pgdata, user=server.system_user,
               timeout=60)
    except Exception:  # already stopped
        pass


def test_postgres_crash_restart__runs_in_flight_all_finish_once(private_server: Any) -> None:
    from pgserver._commands import pg_ctl  # type: ignore[attr-defined]

    dsn = str(private_server.get_uri())
    with connect(dsn, autocommit=True) as conn:
        migrate(conn)
        ids = [runpool.enqueue(conn, "acme", "sleep", {"seconds": 2}) for _ in range(20)]
    with running_pool(dsn, workers=2, concurrency=10, lease_seconds=6) as pool:
        with connect(dsn, autocommit=True) as conn:
            wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                    " WHERE status = 'running'") == 20, what="20 in flight")
            # The host's LISTEN connection is up too (claims planned ahead can beat it).
            wait_for(lambda: conn.execute(LISTENING).fetchone() == (1,), what="the LISTEN")
        # A crash: every backend killed at once, then crash recovery replays the WAL.
        pg_ctl(["-w", "-m", "immediate", "restart"], pgdata=private_server.pgdata,
               user=private_server.system_user, timeout=60)

        def all_done() -> bool:
            try:
                with connect(dsn, autocommit=True) as c:
                    return bool(scalar(c, "SELECT count(*) FROM runpool.runs"
                                       " WHERE status = 'succeeded'") == 20)
            except psycopg.OperationalError:
                return False  # still recovering

        wait_for(all_done, timeout=60, what="every run finished after the restart")
        assert "action=listen_lost" in pool.log()  # the crash really cut the workers off
    with connect(dsn, autocommit=True) as conn:
        for run_id in ids:
            kinds = events(conn, run_id)
            assert kinds.count("succeeded") == 1 and kinds[-1] == "succeeded", kinds
        assert_invariants(conn)


def test_supervisor_sigkilled_while_the_database_is_silent__workers_still_exit(
        conn: psycopg.Connection, dsn: str, proxy: Proxy) -> None:
    # An orphaned worker has nobody to answer to: whatever its shutdown waits on (here every
    # statement of its release and unregister, black-holed), it must not outlive its supervisor
    # for long. Its runs are then reclaimed when their leases expire, as after any crash.
    run_id = runpool.enqueue(conn, "acme", "sleep", {"seconds": 60})
    with running_pool(proxy.dsn(dsn), workers=2, lease_seconds=30) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "running", what="claim")
        workers = live_workers(conn)
        proxy.blackholed.set()
        pool.send_signal(signal.SIGKILL)
        pool.wait(timeout=10)
        wait_for(lambda: not any(pid_alive(pid) for _, pid in workers), timeout=15,
                 what="orphaned workers to exit")
        proxy.blackholed.clear()
