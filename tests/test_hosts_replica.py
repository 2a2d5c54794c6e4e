"""A read replica for the console and `status` (RUNPOOL_READ_DSN, issue 19): a real streaming
standby serves the read-only commands and the console's pages; writes (enqueue, cancel, retry,
signal, the run API) and the run API's reads stay on the primary. A standby refuses every
write, so a write sent to it would fail here: that the writes work is the proof they went to
the primary, and the standby's pg_stat_activity shows the reads did go to it."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from typing import Any

import httpx
import psycopg

import runpool
from runpool.db import connect
from runpool.web import create_app
from tests.clusters import migrated_database, synchronous_pair
from tests.helpers import ROOT, pool_env, scalar, wait_for
from tests.webserver import serving

# Sessions of this database on a server, by application name.
SESSIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = %s
"""


def _cli(dsn: str, read_dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runpool", *args],
        env={**pool_env(dsn), "RUNPOOL_READ_DSN": read_dsn}, cwd=ROOT, capture_output=True,
        text=True, timeout=60)


def _replayed(standby: psycopg.Connection[Any], run_id: uuid.UUID, status: str) -> bool:
    # A synchronous standby confirms a commit once it has the WAL, and may apply it later: at
    # first it may not even have replayed the migrations (CI saw runpool.runs missing).
    try:
        row = standby.execute("SELECT status FROM runpool.runs WHERE id = %s",
                              (run_id,)).fetchone()
    except psycopg.errors.UndefinedTable:
        return False
    return row == (status,)


def test_replica__status_and_console_read_the_standby_writes_go_to_the_primary() -> None:
    with synchronous_pair() as (primary, standby):
        dsn = migrated_database(primary.dsn())
        name = psycopg.conninfo.conninfo_to_dict(dsn)["dbname"]
        replica = standby.dsn(str(name))
        with connect(dsn, autocommit=True) as conn, connect(replica, autocommit=True) as ro:
            assert scalar(ro, "SELECT pg_is_in_recovery()") is True
            run_id = runpool.enqueue(conn, "acme", "noop", {})
            wait_for(lambda: _replayed(ro, run_id, "queued"), what="the standby to replay")

            # The read-only commands read the standby, and say so.
            out = _cli(dsn, replica, "status", "--json")
            assert out.returncode == 0, out.stderr
            report = json.loads(out.stdout)
            assert report["replica"]["in_recovery"] is True
            assert report["tenants"]["acme"]["queued"] == 1
            out = _cli(dsn, replica, "status")
            assert out.returncode == 0 and "read from a replica" in out.stdout, out.stderr
            for args in (["runs", str(run_id), "--json"], ["explain", str(run_id)],
                         ["schedules"]):
                out = _cli(dsn, replica, *args)
                assert out.returncode == 0, (args, out.stderr)

            # Writes with the read DSN set go to the primary (the standby would refuse them).
            out = _cli(dsn, replica, "cancel", str(run_id), "--reason", "replica test")
            assert (out.returncode, out.stdout.strip()) == (0, "cancelled"), out.stderr
            assert scalar(conn, "SELECT status FROM runpool.runs WHERE id = %s",
                          run_id) == "cancelled"
            out = _cli(dsn, replica, "retry", str(run_id))
            assert out.returncode == 0, out.stderr
            out = _cli(dsn, replica, "enqueue", "acme", "noop")
            assert out.returncode == 0, out.stderr
            wait_for(lambda: scalar(ro, "SELECT count(*) FROM runpool.runs") == 2,
                     what="the enqueue replayed")

            # The console: pages and /metrics from the standby, the run API on the primary.
            with serving(create_app(dsn, read_dsn=replica)) as url, \
                    httpx.Client(base_url=url, timeout=30) as client:
                for page in ("/", "/runs", "/stuck", "/dead", "/workers", "/schedules",
                             f"/runs/{run_id}", "/metrics"):
                    assert client.get(page).status_code == 200, page
                assert scalar(ro, SESSIONS, "runpool-web-read") >= 1
                created = client.post("/api/runs", json={"tenant": "acme", "handler": "noop"})
                assert created.status_code == 201, created.text
                new = created.json()["id"]
                # Read back at once: the run API reads the primary, never a lagging replica.
                assert client.get(f"/api/runs/{new}").json()["status"] == "queued"
                answer = client.post(f"/api/runs/{new}/cancel", json={"reason": "api"})
                assert answer.json() == {"status": "cancelled"}, answer.text
                assert client.post(f"/api/runs/{new}/retry", json={}).status_code == 200
                signal = client.post(f"/api/runs/{new}/signals/go", json={})
                assert signal.status_code == 200, signal.text
                assert client.get("/healthz").status_code == 200
                assert scalar(ro, SESSIONS, "runpool-web") == 0
