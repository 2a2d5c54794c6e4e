"""What a hostile tenant or login can send a pool: poison inputs and forged NOTIFY floods.

Used by the soak and the tests to show that none of it costs a worker, or another tenant's
run, anything (issue 11).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

__all__ = [
    "DEEP_JSON",
    "POISON_INPUTS",
    "enqueue_raw",
    "notify_flood",
    "unprivileged_login",
]

# Valid jsonb that orjson refuses to decode: it stops at 1,024 levels of nesting.
DEEP_JSON: Final = "[" * 2000 + "]" * 2000
# Inputs jsonb stores but the worker's decoder refuses.
POISON_INPUTS: Final = (
    DEEP_JSON,
    '{"a":' * 1500 + "1" + "}" * 1500,
    '{"prompt": "hello", "context": ' + DEEP_JSON + "}",
)
# Enqueue through the SQL API, as an API login would: no Python-side check in the way.
SQL_ENQUEUE: Final = """
SELECT runpool.enqueue(%(tenant)s, %(handler)s, %(input)s::jsonb,
                       max_attempts => %(max_attempts)s)
"""
# Forged cancel notices with random run ids, in one transaction (delivered at its commit).
FORGED_CANCELS: Final = """
SELECT pg_notify('runpool_cancel', gen_random_uuid()::text) FROM generate_series(1, %(n)s)
"""
# Forged cancel notices naming real runs, one each (only the database's flag may decide a
# cancel); repeated in separate transactions, as one folds identical notices together.
NAMED_CANCELS: Final = """
SELECT pg_notify('runpool_cancel', id::text) FROM unnest(%(ids)s::uuid[]) AS id
"""
# Malformed cancel notices: noise the listener must ignore without logging each one.
NOISE: Final = """
SELECT pg_notify('runpool_cancel', 'not a run id ' || i) FROM generate_series(1, %(n)s) AS i
"""
# One doorbell (a payload of its own, so notices of one transaction are not folded together).
WAKEUP: Final = "SELECT pg_notify('runpool_wakeup', %(payload)s)"
# A login with no privileges at all (the role name is an identifier composed by psycopg.sql).
CREATE_LOGIN: Final = "CREATE ROLE {} LOGIN"
DROP_LOGIN: Final = "DROP ROLE IF EXISTS {}"


def enqueue_raw(conn: psycopg.Connection[Any], tenant: str, input_json: str, *,
                handler: str = "noop", max_attempts: int | None = None) -> uuid.UUID:
    """Enqueue JSON text as given, through the SQL API; returns the run id."""
    row = conn.execute(SQL_ENQUEUE, {"tenant": tenant, "handler": handler,
                                     "input": input_json, "max_attempts": max_attempts}
                       ).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


@contextmanager
def unprivileged_login(admin_dsn: str) -> Iterator[str]:
    """A role created with LOGIN and nothing else, dropped afterwards; yields its DSN (it can
    connect and NOTIFY, as any login can)."""
    role = f"runpool_hostile_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL(CREATE_LOGIN).format(sql.Identifier(role)))
    try:
        yield make_conninfo(admin_dsn, user=role, password=None)
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                          " WHERE usename = %s", (role,))
            admin.execute(sql.SQL(DROP_LOGIN).format(sql.Identifier(role)))


def notify_flood(dsn: str, *, cancels: int = 0, named: Iterable[uuid.UUID] = (),
                 named_each: int = 0, noise: int = 0, wakeups: int = 0) -> None:
    """Send forged notices from `dsn`'s login: `cancels` random-id cancels and `noise`
    malformed ones (one transaction each), `named_each` cancels for each run in `named`, and
    `wakeups` doorbells, each in a transaction of its own (so they arrive spread out)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if cancels:
            conn.execute(FORGED_CANCELS, {"n": cancels})
        if noise:
            conn.execute(NOISE, {"n": noise})
        ids = list(named)
        for _ in range(named_each if ids else 0):
            conn.execute(NAMED_CANCELS, {"ids": ids})
        for i in range(wakeups):
            conn.execute(WAKEUP, {"payload": str(i)})
