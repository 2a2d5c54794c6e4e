"""Network faults between workers and the database, through a real TCP proxy."""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

import runpool
from tests.helpers import events, run_row, running_pool, wait_for
from tests.proxy import Proxy


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
