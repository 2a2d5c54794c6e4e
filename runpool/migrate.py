"""Applies migrations/NNNN_name.sql (runpool.migration_files) in order, once, under an
advisory lock; then the hot statements' functions (runpool.pooled).
"""

from __future__ import annotations

import logging
from typing import Any, Final, LiteralString, cast

import psycopg
from psycopg import sql

from . import pooled
from .errors import SchemaOutOfDate, UnsafeSchema, UsageError
from .migration_files import Migration, latest_version, migrations

__all__ = [
    "Migration", "applied_versions", "check", "check_owner", "latest_version", "migrate",
    "migrations", "pending", "script",
]

logger = logging.getLogger("runpool.migrate")

# The database encoding runpool's text fits in. Not SQL_ASCII either: it stores any bytes an
# SQL caller sends, and one run holding bytes that are not UTF-8 (say its input) then fails
# every claim that reads it on runpool's UTF8 connections, so no worker can run anything.
SERVER_ENCODINGS: Final = ("UTF8",)
# Serialises migrators across hosts: the second waits, then finds nothing left to do.
LOCK_MIGRATIONS: Final = "SELECT pg_advisory_xact_lock(7370720115)"
# Creates what migrations are recorded in.
BOOTSTRAP: Final = """
CREATE SCHEMA IF NOT EXISTS runpool;
CREATE TABLE IF NOT EXISTS runpool.schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""
# Versions already applied; NULL table means a database never migrated.
APPLIED: Final = """
SELECT version FROM runpool.schema_migrations
WHERE to_regclass('runpool.schema_migrations') IS NOT NULL
ORDER BY version
"""
# Who owns the schema, whether the migrating role may act as that owner, and whether anyone
# but the owner may create objects in it (they could plant a table or function that the
# owner's code would then use).
SCHEMA_OWNER: Final = """
SELECT n.nspowner::regrole::text, pg_has_role(current_user, n.nspowner, 'USAGE'),
       EXISTS (SELECT 1 FROM aclexplode(n.nspacl) a
               WHERE a.privilege_type = 'CREATE' AND a.grantee <> n.nspowner)
FROM pg_namespace n WHERE n.nspname = 'runpool'
"""
HAS_TABLE: Final = "SELECT to_regclass('runpool.schema_migrations') IS NOT NULL"
RECORD: Final = "INSERT INTO runpool.schema_migrations (version, name) VALUES (%s, %s)"
# Live pools that registered no handlers: code older than migration 0006, which claims runs of
# every handler (live as explain_run counts it: not stopped, seen within the last minute).
OLD_POOLS: Final = """
SELECT host, pid FROM runpool.workers
WHERE handlers IS NULL AND stopped_at IS NULL AND last_seen_at > now() - interval '1 minute'
ORDER BY host, pid
"""
# Whether every login may connect to this database (PUBLIC's default CONNECT privilege).
PUBLIC_CONNECT: Final = "SELECT has_database_privilege('public', current_database(), 'CONNECT')"
# The same record, spelled with literals for a script that psql runs (`migrate --sql`).
RECORD_LITERAL: Final = sql.SQL(
    "INSERT INTO runpool.schema_migrations (version, name) VALUES ({}, {});")


def applied_versions(conn: psycopg.Connection[Any]) -> set[int]:
    row = conn.execute(HAS_TABLE).fetchone()
    if not row or not row[0]:
        return set()
    return {v for (v,) in conn.execute(APPLIED)}


def pending(conn: psycopg.Connection[Any]) -> list[Migration]:
    done = applied_versions(conn)
    return [m for m in migrations() if m.version not in done]


def migrate(conn: psycopg.Connection[Any]) -> list[Migration]:
    """Apply what is missing, all in one transaction; returns what was applied."""
    check_encoding(conn)
    with conn.transaction():
        conn.execute(LOCK_MIGRATIONS)
        check_owner(conn)
        conn.execute(BOOTSTRAP)
        todo = pending(conn)
        for m in todo:
            # Migration files are static text shipped with the package, never user input.
            conn.execute(cast(LiteralString, m.sql))  # type: ignore[redundant-cast]
            conn.execute(RECORD, (m.version, m.name))
        # The hot statements' functions for workers behind a pooler: made from the schema
        # as migrated, so in the same transaction, after the migrations.
        made = pooled.install(conn)
    if made:
        logger.info("created %d hot functions for workers behind a pooler", made,
                    extra={"action": "hot_functions_created", "functions": made})
    warn_old_pools(conn)
    warn_public_connect(conn)
    return todo


def check_encoding(conn: psycopg.Connection[Any]) -> None:
    """Refuse a database that cannot hold every run's text: runs, messages and results are
    any Unicode text, and a LATIN1 database, say, fails a write with a character outside it
    (the migrations themselves hold some); see SERVER_ENCODINGS for SQL_ASCII."""
    encoding = conn.info.parameter_status("server_encoding")
    if encoding not in SERVER_ENCODINGS:
        raise UsageError(
            f"database {conn.info.dbname} is encoded {encoding}: runpool needs a UTF8 database"
            " (CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)")


def warn_public_connect(conn: psycopg.Connection[Any]) -> None:
    """Log a warning when every login may connect to runpool's database. Any connected login
    can take the advisory locks of a serial key (keeping the key headless while it holds them)
    and send runpool's notifications; no privilege covers either, so only CONNECT keeps
    untrusted logins out (README: Hostile tenants and logins)."""
    row = conn.execute(PUBLIC_CONNECT).fetchone()
    if row and row[0]:
        db = conn.info.dbname
        logger.warning(
            "PUBLIC may CONNECT to database %s: any login can then hold a serial key's advisory"
            " locks and send runpool's notifications; REVOKE CONNECT ON DATABASE %s FROM"
            " PUBLIC and grant it to runpool's roles", db, db,
            extra={"action": "public_connect", "database": db})


def warn_old_pools(conn: psycopg.Connection[Any]) -> None:
    """Log a warning naming the live pools that run code older than migration 0006. Such a
    pool goes on claiming after the upgrade, and it claims runs of every handler, including
    new ones it does not serve (they fail `unknown_handler`); the schema cannot stop it without
    a check on every claim, so the operator is told to replace it."""
    if 6 not in applied_versions(conn):
        return
    old = conn.execute(OLD_POOLS).fetchall()
    if old:
        pools = ", ".join(f"{host} pid {pid}" for host, pid in old)
        logger.warning(
            "%d live pool(s) run runpool code older than migration 0006 (%s): they claim runs"
            " of every handler, and a run of a handler they do not serve fails unknown_handler;"
            " replace them before enqueueing runs of new handlers", len(old), pools,
            extra={"action": "old_pools_live", "pools": len(old)})


def check_owner(conn: psycopg.Connection[Any]) -> None:
    """Refuse to migrate a `runpool` schema that someone else controls: its owner (or anyone
    it lets create objects) could replace what the SECURITY DEFINER functions rely on."""
    row = conn.execute(SCHEMA_OWNER).fetchone()
    if row is None:
        return  # created by BOOTSTRAP, owned by the migrating role
    owner, ours, others_create = row
    if not ours:
        raise UnsafeSchema(
            f"the runpool schema is owned by {owner}, which the migrating role"
            " is not a member of; migrate as its owner, or drop the schema first")
    if others_create:
        raise UnsafeSchema(
            "roles other than the owner may create objects in the runpool schema;"
            " REVOKE CREATE ON SCHEMA runpool FROM them before migrating")


def script(conn: psycopg.Connection[Any]) -> str:
    """What `migrate` would do, as one psql script: the bootstrap, every pending migration and
    its record, in one transaction under the same lock (`migrate --sql | psql`)."""
    check_owner(conn)  # a script for a schema someone else controls would be unsafe too
    parts = ["BEGIN;", LOCK_MIGRATIONS + ";", BOOTSTRAP.strip() + ";"]
    todo = pending(conn)
    for m in todo:
        parts.append(f"-- {m.version:04d}_{m.name}.sql")
        # A file's last statement may lack its semicolon (or end in a comment): psql needs one.
        parts.extend((m.sql.strip(), ";"))
        parts.append(RECORD_LITERAL.format(m.version, m.name).as_string(conn))
    if todo:
        # Described on the migrated schema, they can be made only once this script has run.
        parts.append("-- then run `migrate --sql` again: it adds the hot statements' functions"
                     " for workers behind a pooler (runpool.pooled)")
    else:
        parts.extend(c.as_string(conn) + ";" for c in pooled.creations(conn))
    parts.append("COMMIT;")
    return "\n".join(parts) + "\n"


def check(conn: psycopg.Connection[Any]) -> None:
    """Refuse to run on a database whose encoding cannot hold runs' text, or on a schema this
    code does not match."""
    check_encoding(conn)
    known = {m.version for m in migrations()}
    done = applied_versions(conn)
    missing = sorted(known - done)
    if missing:
        raise SchemaOutOfDate(
            f"the database schema is out of date (missing migrations {missing});"
            " run `python -m runpool migrate` first"
        )
    newer = sorted(done - known)
    if newer:
        raise SchemaOutOfDate(
            f"the database schema has migrations this runpool does not know ({newer});"
            " upgrade runpool on this host"
        )
