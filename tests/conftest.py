"""Test databases: RUNPOOL_TEST_DSN's server if set, else an embedded PostgreSQL.

A template database is migrated once per session; every test gets its own database cloned
from it, so tests never see each other's runs.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from runpool.db import connect
from runpool.embedded import start_embedded
from runpool.testing import EXECUTIONS_DDL, database_name, scratch_database

# One row per model turn the scripted agent (tests/apps.py) would have paid for.
MODEL_CALLS_DDL = "CREATE TABLE model_calls (run_id uuid, turn int, attempt int)"


@pytest.fixture(scope="session")
def server_dsn() -> str:
    dsn = os.environ.get("RUNPOOL_TEST_DSN")
    if dsn:
        return dsn
    data_dir = Path(tempfile.gettempdir()) / "runpool-test-pgdata"
    return start_embedded(data_dir)


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    with scratch_database(server_dsn, prefix="runpool_tmpl") as tmpl:
        with connect(tmpl, autocommit=True) as conn:
            # The test handlers' side tables: what a real model and real tools would have done.
            conn.execute(EXECUTIONS_DDL)
            conn.execute(MODEL_CALLS_DDL)
        yield database_name(tmpl)


@pytest.fixture
def dsn(server_dsn: str, template_db: str) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    with scratch_database(server_dsn, prefix="runpool_test", template=template_db,
                          migrated=False) as db:
        yield db


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A database with no runpool schema at all."""
    with scratch_database(server_dsn, prefix="runpool_empty", migrated=False) as db:
        yield db


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with connect(dsn, autocommit=True) as c:
        yield c
