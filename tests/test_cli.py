from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import psycopg
import pytest
from psycopg.types.json import Jsonb

import checkpoints
import runpool
from runpool import cli as runpool_cli
from runpool import pooled
from runpool.db import aconnect, connect
from runpool.migrate import applied_versions, check, migrate, migrations
from runpool.testing.databases import create_database, drop_database, with_database
from runpool.trips import HOT_STATEMENTS
from tests.helpers import ROOT, pool_env, run_row, running_pool, wait_for


def cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runpool", *args], env=pool_env(dsn), cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_enqueue_cancel_retry__round_trip(conn: psycopg.Connection, dsn: str) -> None:
    out = cli(dsn, "enqueue", "acme", "noop", "--input", '{"q": 1}', "--priority", "3")
    assert out.returncode == 0, out.stderr
    run_id = uuid.UUID(out.stdout.strip())
    assert (run_row(conn, run_id)["input"], run_row(conn, run_id)["priority"]) == ({"q": 1}, 3)
    out = cli(dsn, "cancel", str(run_id), "--reason", "changed my mind")
    assert (out.returncode, out.stdout.strip()) == (0, "cancelled")
    assert run_row(conn, run_id)["cancel_reason"] == "changed my mind"
    out = cli(dsn, "retry", str(run_id))
    assert (out.returncode, out.stdout.strip()) == (0, "queued")


def test_signal__stores_then_answers_the_terminal_status_bad_payload_refused(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    out = cli(dsn, "signal", str(run_id), "approval", "--payload", '{"approved": true}')
    assert (out.returncode, out.stdout.strip()) == (0, "stored"), out.stderr
    assert conn.execute("SELECT name, payload FROM runpool.signals").fetchall() \
        == [("approval", {"approved": True})]
    out = cli(dsn, "signal", str(run_id), "approval", "--tenant", "globex")
    assert out.returncode == 1 and "no such run" in out.stderr, out.stderr
    out = cli(dsn, "signal", str(run_id), "approval", "--payload", "{nope")
    assert out.returncode == 2 and "--payload is not valid JSON" in out.stderr
    out = cli(dsn, "signal", str(run_id), "")
    assert out.returncode == 2 and "signal name must be 1 to 200" in out.stderr, out.stderr
    assert conn.execute("SELECT count(*) FROM runpool.signals").fetchone() == (1,)
    assert conn.execute("SELECT runpool.cancel_run(%s)", (run_id,)).fetchone() == ("cancelled",)
    out = cli(dsn, "signal", str(run_id), "approval")
    assert (out.returncode, out.stdout.strip()) == (0, "cancelled")


def test_bad_ids_and_input__clear_errors_and_exit_codes(conn: psycopg.Connection,
                                                       dsn: str) -> None:
    for command in ("cancel", "retry"):
        out = cli(dsn, command, "not-a-uuid")
        assert out.returncode == 2 and "not a run id" in out.stderr, out.stderr
        out = cli(dsn, command, str(uuid.uuid4()))
        assert out.returncode == 1 and "no such run" in out.stderr, out.stderr
    out = cli(dsn, "enqueue", "acme", "noop", "--input", "{not json")
    assert out.returncode == 2 and "--input is not valid JSON" in out.stderr
    out = cli(dsn, "enqueue", "acme", "noop", "--priority", "500")
    assert out.returncode == 2 and "priority must be between -100 and 100" in out.stderr
    assert conn.execute("SELECT count(*) FROM runpool.runs").fetchone() == (0,)


def test_status_json__counts_stuck_failures_and_latency(conn: psycopg.Connection,
                                                        dsn: str) -> None:
    ids = {name: runpool.enqueue(conn, tenant, "noop") for name, tenant in (
        ("q1", "acme"), ("q2", "acme"), ("live", "acme"), ("stuck", "globex"),
        ("failed", "globex"), ("done", "globex"))}
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (ids["live"],))
    conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),"
                 " lease_expires_at = now() - interval '5 seconds' WHERE id = %s",
                 (ids["stuck"],))
    conn.execute("UPDATE runpool.runs SET status = 'failed', attempt = 3, started_at = now(),"
                 " finished_at = now(), error = '{\"reason\": \"exception\","
                 " \"message\": \"boom\"}' WHERE id = %s", (ids["failed"],))
    conn.execute("UPDATE runpool.runs SET status = 'succeeded', attempt = 1,"
                 " started_at = created_at + interval '2 seconds',"
                 " finished_at = created_at + interval '5 seconds' WHERE id = %s", (ids["done"],))
    out = cli(dsn, "status", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)  # exactly one JSON document
    assert report["tenants"] == {
        "acme": {"queued": 2, "running": 1, "waiting": 0, "succeeded": 0, "failed": 0,
                 "cancelled": 0},
        "globex": {"queued": 0, "running": 1, "waiting": 0, "succeeded": 1, "failed": 1,
                   "cancelled": 0}}
    assert report["stuck"] == 1
    in_flight = {r["id"]: r for r in report["in_flight"]}
    assert in_flight[str(ids["stuck"])]["lease_left_s"] < 0 < in_flight[str(ids["live"])][
        "lease_left_s"]
    assert [(f["id"], f["reason"], f["message"]) for f in report["failures"]] == [
        (str(ids["failed"]), "exception", "boom")]
    assert report["latency"]["finished_runs"] == 2
    text = cli(dsn, "status").stdout
    assert "stuck 1" in text and "python -m runpool retry RUN_ID" in text


def test_runs__shows_one_runs_history(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")
    conn.execute("SELECT runpool.cancel_run(%s, 'changed my mind')", (run_id,))
    out = cli(dsn, "runs", str(run_id))
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("cancelled")
    assert "enqueued" in out.stdout and "cancelled" in out.stdout
    doc = json.loads(cli(dsn, "runs", str(run_id), "--json").stdout)
    assert [e["kind"] for e in doc["events"]] == ["enqueued", "cancelled"]
    assert cli(dsn, "runs", str(uuid.uuid4())).returncode == 1


def test_bad_settings__refused_before_anything_starts(dsn: str) -> None:
    out = subprocess.run([sys.executable, "-m", "runpool", "--app", "tests.apps:app"],
                         env=pool_env(dsn, lease_seconds="-1"), cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "lease_seconds must be > 0" in out.stderr


def test_bad_dsn__refused_before_anything_starts_without_echoing_its_password(
        server_dsn: str) -> None:
    """A DSN libpq cannot parse is refused as the settings are read (exit 2, before any
    fork): it used to crash-loop the workers, each traceback showing the DSN's password."""
    bad = "postgresql://postgres:secret%zz123@127.0.0.1:5432/postgres"
    for command in (["worker", "--app", "tests.apps:app"], ["status"]):
        out = subprocess.run([sys.executable, "-m", "runpool", *command],
                             env=pool_env(bad), cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2, (command, out.stderr)
        assert "dsn is not a PostgreSQL connection string: invalid percent-encoded token" \
            in out.stderr, out.stderr
        assert "secret" not in out.stderr and "Traceback" not in out.stderr, out.stderr
    with pytest.raises(runpool.InvalidInput, match="dsn is not a PostgreSQL") as raised:
        runpool.Pool("tests.apps:app", dsn=bad)
    assert "secret" not in str(raised.value)
    # A command on a database that cannot be connected to: one line, no traceback.
    missing = with_database(server_dsn, f"runpool_missing_{uuid.uuid4().hex[:8]}")
    out = cli(missing, "status")
    assert out.returncode == 1, out.stderr
    assert out.stderr.startswith("runpool: dsn (RUNPOOL_DSN) cannot be connected to: "), \
        out.stderr
    assert out.stderr.count("\n") == 1 and "does not exist" in out.stderr, out.stderr


def test_app_that_cannot_be_loaded__exits_78_as_documented(dsn: str) -> None:
    # 78 is "cannot run here as configured" (README, `--help`); it used to be 1.
    for app, says in (("no.such.module:app", "cannot import app module"),
                      ("tests.apps:no_such_attribute", "is not a runpool.App"),
                      ("tests.helpers:wait_for", "is not a runpool.App"),
                      ("tests.boom_app:app", "cannot import app module 'tests.boom_app': it"
                       " raised RuntimeError: import boom: RUNPOOL_TEST_SETTING is not set")):
        out = subprocess.run([sys.executable, "-m", "runpool", "worker", "--app", app],
                             env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 78 and says in out.stderr, (app, out.stderr)
        # One line naming the module and the exception, no traceback.
        assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr, out.stderr


def test_commands_on_an_unmigrated_database__name_the_fix(empty_dsn: str) -> None:
    out = cli(empty_dsn, "enqueue", "acme", "noop")
    assert out.returncode == 1 and "python -m runpool migrate" in out.stderr, out.stderr


# -- the pool command, flags and version ------------------------------------------------------

LISTENERS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND query LIKE 'LISTEN runpool_wakeup%%'
"""


def test_version__flag_and_attribute_agree(dsn: str) -> None:
    out = cli(dsn, "--version")
    assert (out.returncode, out.stdout.strip()) == (0, f"runpool {runpool.__version__}")
    assert runpool.__version__ == "0.1.0"


def test_worker_command__its_own_help_and_app_flag(conn: psycopg.Connection,
                                                   dsn: str) -> None:
    out = cli(dsn, "worker", "--help")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m runpool worker")
    assert "--app APP" in out.stdout and "--listen, --no-listen" in out.stdout
    run_id = runpool.enqueue(conn, "acme", "noop")
    proc = subprocess.Popen(
        [sys.executable, "-m", "runpool", "worker", "--app", "tests.apps:app", "--workers",
         "1", "--no-listen", "--poll", "0.2"],
        env=pool_env(dsn), cwd=ROOT, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=20,
                 what="the run, picked up by polling")
        # --no-listen: no worker holds a LISTEN connection.
        assert conn.execute(LISTENERS).fetchone() == (0,)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_boolean_flags__yes_and_no_forms_win_over_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def listen(*argv: str) -> bool:
        return runpool_cli._settings(runpool_cli._parser().parse_args(["worker", *argv])).listen

    monkeypatch.setenv("RUNPOOL_LISTEN", "0")
    assert (listen(), listen("--listen"), listen("--no-listen")) == (False, True, False)
    monkeypatch.setenv("RUNPOOL_LISTEN", "1")
    assert (listen(), listen("--no-listen")) == (True, False)


# -- migrate --sql ------------------------------------------------------------------------------

def _psql() -> str:
    found = shutil.which("psql")
    if found:
        return found
    import pgserver  # the embedded server's binaries include psql

    return str(Path(pgserver.__file__).parent / "pginstall" / "bin" / "psql")


def test_migrate_sql__piped_to_psql_creates_the_schema_then_the_hot_functions(
        empty_dsn: str) -> None:
    """The hot statements' functions are described on the migrated schema: a script with
    migrations to apply says to run it again, and the next one creates them."""
    def applied(script: str) -> None:
        done = subprocess.run([_psql(), "-X", "-q", "-v", "ON_ERROR_STOP=1", empty_dsn],
                              input=script, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def script() -> str:
        made = cli(empty_dsn, "migrate", "--sql")
        assert made.returncode == 0, made.stderr
        return made.stdout

    first = script()
    assert "CREATE TABLE runpool.runs" in first and "`migrate --sql` again" in first
    applied(first)
    with connect(empty_dsn, autocommit=True) as conn:
        check(conn)  # what a worker checks before it starts
        assert applied_versions(conn) == {m.version for m in migrations()}
        assert len(pooled.missing(conn)) == len(HOT_STATEMENTS)
    second = script()
    assert "CREATE TABLE runpool.runs" not in second
    assert second.count("CREATE OR REPLACE FUNCTION runpool.\"hot_") == len(HOT_STATEMENTS)
    applied(second)
    with connect(empty_dsn, autocommit=True) as conn:
        assert pooled.missing(conn) == []
        assert migrate(conn) == []
        runpool.enqueue(conn, "acme", "noop")
    third = script()  # nothing left to do, and psql says so by doing nothing
    assert "FUNCTION" not in third and "CREATE TABLE runpool.runs" not in third
    applied(third)


# -- errors -------------------------------------------------------------------------------------

def test_lease_lost__is_a_runpool_error_and_checkpoints_imports_no_runpool() -> None:
    assert issubclass(runpool.LeaseLost, runpool.RunpoolError)
    assert issubclass(runpool.LeaseLost, checkpoints.LeaseLost)
    assert issubclass(runpool.DatabaseTimeout, TimeoutError)
    out = subprocess.run(
        [sys.executable, "-c", "import sys, checkpoints; print(sorted(m for m in sys.modules"
                               " if m.split('.')[0] == 'runpool'))"],
        env=pool_env(""), cwd=ROOT, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_refused_checkpoint_write_and_detached_run__raise_runpool_errors(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "noop")  # queued: no attempt holds its lease

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            with pytest.raises(runpool.RunpoolError) as info:
                await checkpoints.append_message(c, run_id, 1, "assistant", Jsonb("late"))
            assert isinstance(info.value, runpool.LeaseLost)
        detached = runpool.Run(id=run_id, tenant="acme", handler="noop", attempt=1, input={})
        with pytest.raises(runpool.RunpoolError, match="not attached to a database"):
            await detached.add_message("assistant", "hello")
        with pytest.raises(runpool.UsageError, match="plain `def` handlers"):
            detached.add_message_sync("assistant", "hello")  # on the loop: would hang it

    asyncio.run(main())


def test_demo__completes_with_no_run_left_waiting(conn: psycopg.Connection, dsn: str) -> None:
    # 12 runs hold one of each kind: research, summarize (one fails) and a translate run that
    # no pool of the demo serves, which waits until the demo explains and cancels it.
    # Its output goes to files, so it never waits on a pipe while this waits for it to end.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        demo = subprocess.Popen([sys.executable, "-m", "runpool", "demo", "--runs", "12"],
                                env=pool_env(dsn), cwd=ROOT, stdout=out, stderr=err, text=True)
        try:
            wait_for(lambda: demo.poll() is not None, timeout=90, interval=0.2,
                     what="the demo to finish")
        except AssertionError:
            # Ctrl-C: the demo drains and stops its pool on the way out.
            demo.send_signal(signal.SIGINT)
            demo.wait(timeout=90)
            raise
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    assert demo.returncode == 0, stderr
    assert "no live pool serves handler translate" in stdout, stdout
    # The run whose worker was killed resumes; the cancelled run is another one.
    killed = re.search(r"while it runs agent run ([0-9a-f-]{36})", stdout)
    cancelled = re.search(r"runpool\.cancel_run\('([0-9a-f-]{36})', 'user pressed stop'\)",
                          stdout)
    assert killed and cancelled and killed[1] != cancelled[1], stdout
    rows: dict[str, int] = dict(conn.execute(
        "SELECT status, count(*) FROM runpool.runs GROUP BY status").fetchall())
    assert rows.get("queued", 0) + rows.get("running", 0) + rows.get("waiting", 0) == 0, rows
    assert conn.execute("SELECT count(*) FROM runpool.runs WHERE handler = 'translate'"
                        " AND status = 'cancelled'").fetchone() == (1,)
    # The second sample waited for approval, got it from another process, and deleted once.
    assert "left its slot: explain_run -> waiting for signal approval" in stdout, stdout
    assert conn.execute(
        "SELECT r.status, r.result ->> 'deleted', (SELECT array_agg(e.tool ORDER BY e.tool)"
        " FROM sample_agent_effects e WHERE e.run_id = r.id)"
        " FROM runpool.runs r WHERE r.handler = 'guarded_delete'").fetchone() \
        == ("succeeded", "true", ["delete_records", "search"])


def test_worker_command__a_database_it_cannot_reach_is_one_line_a_try_and_it_recovers(
        server_dsn: str, template_db: str) -> None:
    """A DSN naming a database that does not exist yet: each worker says so in one line (no
    traceback), the supervisor restarts it with its backoff, and once the database exists
    the pool starts by itself, and drains on SIGTERM."""
    name = f"runpool_later_{uuid.uuid4().hex[:12]}"
    later = with_database(server_dsn, name)
    try:
        with running_pool(later, workers=2, stop="drain") as proc:
            wait_for(lambda: proc.log().count("action=database_unreachable") >= 4,
                     what="two tries of each worker")
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
            assert "dsn (RUNPOOL_DSN) cannot be connected to: connection failed:" in proc.log()
            assert f'database "{name}" does not exist' in proc.log()
            # Migrated as it appears: a worker restarted between a bare CREATE DATABASE and
            # the migration would find no schema and stop the pool (exit 78), as it should.
            create_database(server_dsn, name=name, template=template_db)
            with connect(later, autocommit=True) as conn:
                # The backoff is at most 4 s by the third try.
                wait_for(lambda: proc.log().count("action=worker_started") == 2, timeout=30,
                         what="both workers started")
                run_id = runpool.enqueue(conn, "acme", "noop")
                wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded",
                         what="the run done")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0, proc.log()[-3000:]
            assert "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        drop_database(server_dsn, later)
