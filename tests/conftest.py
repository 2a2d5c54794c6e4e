"""Test databases: RUNPOOL_TEST_DSN's server if set, else an embedded PostgreSQL.

A template database is migrated once per session; every test gets its own database cloned
from it, so tests never see each other's runs.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from runpool.db import connect
from runpool.embedded import start_embedded
from runpool.migrate import migrate


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


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    name = f"runpool_tmpl_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')  # test-only, name generated above
    with connect(_with_db(server_dsn, name), autocommit=True) as conn:
        migrate(conn)
    yield name
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    name = f"runpool_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template_db}"')
    yield _with_db(server_dsn, name)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A database with no runpool schema at all."""
    name = f"runpool_empty_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    yield _with_db(server_dsn, name)
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with connect(dsn, autocommit=True) as c:
        yield c
