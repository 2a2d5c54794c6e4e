"""Test databases: RUNPOOL_TEST_DSN's server if set, else an embedded PostgreSQL.

A template database is migrated once per session; every test gets its own database cloned
from it, so tests never see each other's runs.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runpool.db import connect
from runpool.embedded import start_embedded
from runpool.invariants import EXECUTIONS_DDL
from runpool.migrate import migrate

# One row per model turn the scripted agent (tests/apps.py) would have paid for.
MODEL_CALLS_DDL = "CREATE TABLE model_calls (run_id uuid, turn int, attempt int)"


def _with_db(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def server_dsn() -> str:
    dsn = os.environ.get("RUNPOOL_TEST_DSN")
    if dsn:
        return dsn
    data_dir = Path(tempfile.gettempdir()) / "runpool-test-pgdata"
    return start_embedded(data_dir)


@contextmanager
def _database(server_dsn: str, prefix: str, template: str | None = None) -> Iterator[str]:
    """A database of its own on the test server (cloned from `template`), dropped after."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    try:
        yield name
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    with _database(server_dsn, "runpool_tmpl") as name:
        with connect(_with_db(server_dsn, name), autocommit=True) as conn:
            migrate(conn)
            # The test handlers' side tables: what a real model and real tools would have done.
            conn.execute(EXECUTIONS_DDL)
            conn.execute(MODEL_CALLS_DDL)
        yield name


@pytest.fixture
def dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    with _database(server_dsn, "runpool_test", template_db) as name:
        yield _with_db(server_dsn, name)


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A database with no runpool schema at all."""
    with _database(server_dsn, "runpool_empty") as name:
        yield _with_db(server_dsn, name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with connect(dsn, autocommit=True) as c:
        yield c
