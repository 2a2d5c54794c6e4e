from __future__ import annotations

import subprocess
import sys
import threading

import psycopg
import pytest
from psycopg import sql

from runpool.db import connect
from runpool.errors import SchemaOutOfDate
from runpool.migrate import applied_versions, check, migrate, migrations
from tests.helpers import ROOT, pool_env


def test_migrate__applies_all_then_is_a_noop(empty_dsn: str) -> None:
    with connect(empty_dsn, autocommit=True) as conn:
        with pytest.raises(SchemaOutOfDate, match="python -m runpool migrate"):
            check(conn)
        applied = migrate(conn)
        assert [m.version for m in applied] == [m.version for m in migrations()]
        assert migrate(conn) == []
        check(conn)


def test_migrate__two_hosts_at_once_apply_each_migration_once(empty_dsn: str) -> None:
    results: list[object] = []

    def one() -> None:
        try:
            with connect(empty_dsn, autocommit=True) as conn:
                results.append(len(migrate(conn)))
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sorted(results, key=str) == sorted([0, 0, 0, len(migrations())], key=str)
    with connect(empty_dsn, autocommit=True) as conn:
        assert applied_versions(conn) == {m.version for m in migrations()}


def test_migrate__roles_already_existing_are_tolerated(dsn: str, empty_dsn: str) -> None:
    # `dsn` is a migrated database of the same cluster: the roles exist already.
    with connect(empty_dsn, autocommit=True) as conn:
        migrate(conn)
        roles = {r for (r,) in conn.execute(
            "SELECT rolname FROM pg_roles WHERE rolname LIKE 'runpool_%'")}
    assert {"runpool_api", "runpool_worker"} <= roles


def test_migrate_sql__prints_pending_without_applying(empty_dsn: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runpool", "migrate", "--sql"], env=pool_env(empty_dsn),
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    assert "-- 0001_schema.sql" in out and "CREATE TABLE runpool.runs" in out
    with connect(empty_dsn, autocommit=True) as conn:
        assert applied_versions(conn) == set()


def test_worker_on_out_of_date_schema__refuses_and_names_the_fix(empty_dsn: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "runpool", "--app", "tests.apps:app", "--workers", "1"],
        env=pool_env(empty_dsn), cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 78
    assert "python -m runpool migrate" in proc.stderr
    with psycopg.connect(empty_dsn) as conn:
        assert conn.execute("SELECT to_regclass('runpool.runs')").fetchone() == (None,)


# How a pool running code older than migration 0006 registers (it names no handlers).
OLD_REGISTER = ("INSERT INTO runpool.workers (id, host, pid, concurrency)"
                " VALUES (gen_random_uuid(), 'old-host', %s, 4)")


def test_migrate__warns_about_live_pools_older_than_0006(dsn: str) -> None:
    quiet = subprocess.run([sys.executable, "-m", "runpool", "migrate"], env=pool_env(dsn),
                           cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0 and "older than migration 0006" not in quiet.stderr
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(OLD_REGISTER, (4242,))
        # A stopped one and a current one (handlers named) are not warned about.
        conn.execute(OLD_REGISTER, (4343,))
        conn.execute("UPDATE runpool.workers SET stopped_at = now() WHERE pid = 4343")
        conn.execute("INSERT INTO runpool.workers (id, host, pid, concurrency, handlers)"
                     " VALUES (gen_random_uuid(), 'new-host', 4444, 4, '{noop}')")
    out = subprocess.run([sys.executable, "-m", "runpool", "migrate"], env=pool_env(dsn),
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    warnings = [line for line in out.stderr.splitlines() if "action=old_pools_live" in line]
    assert len(warnings) == 1, out.stderr
    assert "1 live pool(s)" in warnings[0] and "old-host pid 4242" in warnings[0]
    assert "4343" not in warnings[0] and "new-host" not in warnings[0]


def test_migrate__warns_while_every_login_may_connect(dsn: str) -> None:
    def warnings() -> list[str]:
        out = subprocess.run([sys.executable, "-m", "runpool", "migrate"], env=pool_env(dsn),
                             cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr  # a warning, not a failure
        return [line for line in out.stderr.splitlines() if "action=public_connect" in line]

    (line,) = warnings()  # PostgreSQL's default: PUBLIC may connect
    assert "REVOKE CONNECT ON DATABASE" in line
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("REVOKE CONNECT ON DATABASE {} FROM PUBLIC").format(
            sql.Identifier(conn.info.dbname)))
    assert warnings() == []
