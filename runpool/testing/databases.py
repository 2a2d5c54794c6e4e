"""Scratch databases on a PostgreSQL server: one per test or benchmark, dropped afterwards."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from ..db import connect
from ..migrate import migrate

__all__ = ["database_name", "scratch_database", "with_database"]


def with_database(dsn: str, dbname: str) -> str:
    """`dsn` pointed at another database of the same server."""
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


def database_name(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


@contextmanager
def scratch_database(server_dsn: str, *, prefix: str = "runpool_scratch",
                     template: str | None = None, migrated: bool = True) -> Iterator[str]:
    """The DSN of a new database on `server_dsn`'s server (a copy of the database `template`
    if given; with runpool's schema migrated in if `migrated`), dropped when the block exits
    even if connections to it are still open."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    dsn = with_database(server_dsn, name)
    try:
        if migrated:
            with connect(dsn, autocommit=True) as conn:
                migrate(conn)
        yield dsn
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))
