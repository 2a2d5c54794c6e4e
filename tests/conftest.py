"""Test databases: RUNPOOL_TEST_DSN's server if set, else an embedded PostgreSQL.

A template database is migrated once per session; every test gets its own database cloned
from it, so tests never see each other's runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psycopg
import pytest

from runpool.db import connect
from runpool.embedded import start_embedded
from runpool.testing import EXECUTIONS_DDL, database_name, scratch_database
from runpool.testing.databases import create_database, drop_database

# One row per model turn the scripted agent (tests/apps.py) would have paid for.
MODEL_CALLS_DDL = "CREATE TABLE model_calls (run_id uuid, turn int, attempt int)"


# How many test processes `-n auto` (pyproject's addopts) starts. The tests mostly wait
# (leases, timeouts, restarts), so three share two cores well, each with its own embedded
# server: the notification queue, max_connections, roles and the checkpoint a DROP DATABASE
# forces are a server's, and tests sharing one would slow or fail each other. On
# RUNPOOL_TEST_DSN's one server they run in one process.
EMBEDDED_PROCESSES = 3


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return 0 if os.environ.get("RUNPOOL_TEST_DSN") else EMBEDDED_PROCESSES


@pytest.fixture(scope="session")
def server_dsn() -> str:
    dsn = os.environ.get("RUNPOOL_TEST_DSN")
    if dsn:
        return dsn
    worker = os.environ.get("PYTEST_XDIST_WORKER")  # gw0, gw1, ...; unset with -n 0
    base = Path(tempfile.gettempdir()) / "runpool-test-pgdata"
    data_dir = base.with_name(f"{base.name}-{worker}") if worker else base
    # One process at a time: pgserver creates its system user (as root) before it takes its
    # own lock, and two processes' useradd at once fail one of them.
    with open(base.with_name(f"{base.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return start_embedded(data_dir)


@pytest.fixture(scope="session")
def template_db(server_dsn: str) -> Iterator[str]:
    with scratch_database(server_dsn, prefix="runpool_tmpl") as tmpl:
        with connect(tmpl, autocommit=True) as conn:
            # The test handlers' side tables: what a real model and real tools would have done.
            conn.execute(EXECUTIONS_DDL)
            conn.execute(MODEL_CALLS_DDL)
        yield database_name(tmpl)


class _Databases:
    """Test databases cloned from the template one test ahead: cloning costs ~150 ms of
    waiting on the server (CREATE DATABASE), for most of the suite's tests, so the next
    test's clone is made in a thread while this test runs. Drops stay in each test's own
    teardown: a DROP DATABASE forces a checkpoint, which would otherwise land in the middle of
    the next test, and a failed drop is that test's error."""

    def __init__(self, server_dsn: str, template: str) -> None:
        self._server, self._template = server_dsn, template
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="test-databases")
        self._next = self._thread.submit(self._create)

    def _create(self) -> str:
        return create_database(self._server, prefix="runpool_test", template=self._template)

    def take(self) -> str:
        """This test's clone (its failure is this test's error), the next one begun."""
        current, self._next = self._next, self._thread.submit(self._create)
        return current.result(timeout=60)

    def drop(self, dsn: str) -> None:
        drop_database(self._server, dsn)

    def close(self) -> None:
        """Drop the clone no test took."""
        self._thread.shutdown(wait=True)
        with contextlib.suppress(psycopg.Error):
            self.drop(self._next.result())


@pytest.fixture(scope="session")
def _databases(server_dsn: str, template_db: str) -> Iterator[_Databases]:
    databases = _Databases(server_dsn, template_db)
    yield databases
    databases.close()


@pytest.fixture
def dsn(_databases: _Databases) -> Iterator[str]:
    """A fresh, migrated database for this test."""
    db = _databases.take()
    try:
        yield db
    finally:
        _databases.drop(db)


@pytest.fixture
def empty_dsn(server_dsn: str) -> Iterator[str]:
    """A database with no runpool schema at all."""
    with scratch_database(server_dsn, prefix="runpool_empty", migrated=False) as db:
        yield db


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection]:
    with connect(dsn, autocommit=True) as c:
        yield c
