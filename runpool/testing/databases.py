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

__all__ = ["create_database", "database_name", "drop_database", "scratch_database",
           "with_database"]


def with_database(dsn: str, dbname: str) -> str:
    """`dsn` pointed at another database of the same server."""
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)  # type: ignore[arg-type]


def database_name(dsn: str) -> str:
    return str(conninfo_to_dict(dsn)["dbname"])


def create_database(server_dsn: str, *, prefix: str = "runpool_scratch",
                    template: str | None = None, encoding: str | None = None,
                    name: str | None = None) -> str:
    """The DSN of a new database on `server_dsn`'s server, uniquely named after `prefix`
    unless `name` is given (a DSN that already names it): a copy of the database `template`
    if given, or an empty one (in `encoding` if given)."""
    name = name or f"{prefix}_{uuid.uuid4().hex[:12]}"
    create = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        create += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    elif encoding:
        create += sql.SQL(" TEMPLATE template0 ENCODING {} LC_COLLATE 'C' LC_CTYPE 'C'").format(
            sql.Literal(encoding))
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(create)
    return with_database(server_dsn, name)


def drop_database(server_dsn: str, dsn: str) -> None:
    """Drop `dsn`'s database (connected to `server_dsn`'s), even if connections to it are
    still open."""
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(database_name(dsn))))


@contextmanager
def scratch_database(server_dsn: str, *, prefix: str = "runpool_scratch",
                     template: str | None = None, migrated: bool = True,
                     encoding: str | None = None) -> Iterator[str]:
    """The DSN of a new database on `server_dsn`'s server (see create_database; with
    runpool's schema migrated in if `migrated`), dropped when the block exits even if
    connections to it are still open."""
    dsn = create_database(server_dsn, prefix=prefix, template=template, encoding=encoding)
    try:
        if migrated:
            with connect(dsn, autocommit=True) as conn:
                migrate(conn)
        yield dsn
    finally:
        drop_database(server_dsn, dsn)
