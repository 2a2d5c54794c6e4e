"""The hot statements as PL/pgSQL functions, for workers behind a transaction-mode pooler.

Why: behind PgBouncer in transaction mode a worker prepares nothing (the server session is
not its own, and PgBouncer before 1.21 does not carry prepared statements), so each of its hot
statements was planned with its parameters on every call: W1 through PgBouncer drained 0.57x
W1 direct, and a turn's checkpoint writes cost ~1.5x the server CPU (W11cpus). A PL/pgSQL
function keeps its statements' plans in the server session, whichever client the pooler
hands that session to, and leaves its callers no session state: a worker behind a pooler
calls them (runpool.trips, Via "functions") and drains as fast as W1.

`install` (run by `migrate`, in its transaction and under its lock) creates, for each hot
statement (the claim's, the outcome batch's, a group commit's batch statements),
`runpool.hot_<name>_<digest>`: the statement's parameters in $n order, its result columns as
the function's (described on the migrated schema), EXECUTE for runpool_worker only, SECURITY
INVOKER (a caller still needs the statement's own privileges). Named after a digest of the
statement and the schema's version, a function never changes: a fleet mixing versions calls
what each version holds, and a migrate with nothing new creates nothing.
A worker behind a pooler whose database lacks its functions (migrated with `migrate --sql`
by an older script, say) says so and sends the statements themselves (Via "pipeline") until
they are there (Route.watch); one whose functions stop serving it falls back for good.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

import psycopg
from psycopg import sql
from psycopg.pq import ExecStatus
from psycopg_pool import AsyncConnectionPool

from .deadlines import bounded
from .trips import HOT_STATEMENTS, FunctionsUnusable, HotStatement, Via

__all__ = ["Route", "creations", "install", "missing", "route"]

logger = logging.getLogger("runpool.pooled")

# Which of the named functions schema runpool holds for this role to call.
PRESENT: Final = """
SELECT p.proname::text FROM pg_proc p
WHERE p.pronamespace = 'runpool'::regnamespace AND p.proname = ANY(%s)
  AND has_function_privilege(p.oid, 'EXECUTE')
"""
# The names of types, by OID, in order.
TYPE_NAMES: Final = """
SELECT format_type(u.t, NULL) FROM unnest(%s::oid[]) WITH ORDINALITY AS u(t, i) ORDER BY u.i
"""
# One hot function: its arguments' and result's types are names format_type printed, its
# body a hot statement (static text shipped with runpool).
CREATE: Final = sql.SQL(
    "CREATE OR REPLACE FUNCTION runpool.{name}({args}) RETURNS {result}"
    " LANGUAGE plpgsql VOLATILE AS {body};\n"
    "REVOKE ALL ON FUNCTION runpool.{name}({args}) FROM PUBLIC;\n"
    "GRANT EXECUTE ON FUNCTION runpool.{name}({args}) TO runpool_worker")
# A hot statement with result columns. use_column: the result's columns are also the
# function's variables, and a name in the statement means its column, as outside a function.
RETURNING: Final = "#variable_conflict use_column\nBEGIN\nRETURN QUERY {}\n;\nEND"
# One without (an UPDATE that returns nothing).
PLAIN: Final = "BEGIN\n{}\n;\nEND"
_VOID: Final = 2278  # pg_type's void: no column of a function's result may have it


def missing(conn: psycopg.Connection[Any]) -> list[HotStatement]:
    """The hot statements whose functions the database lacks."""
    names = [h.function.decode() for h in HOT_STATEMENTS]
    have = {name for (name,) in conn.execute(PRESENT, (names,))}
    return [h for h in HOT_STATEMENTS if h.function.decode() not in have]


def creations(conn: psycopg.Connection[Any]) -> list[sql.Composed]:
    """The statements that create the missing functions (described on the schema as it is:
    a migrated one). In a transaction (a savepoint in migrate's): through a transaction-mode
    pooler the describe must reach the server session that parsed the statement."""
    with conn.transaction():
        return [_creation(conn, h) for h in missing(conn)]


def install(conn: psycopg.Connection[Any]) -> int:
    """Create the missing functions; returns how many."""
    made = creations(conn)
    for statement in made:
        conn.execute(statement)
    return len(made)


def _creation(conn: psycopg.Connection[Any], hot: HotStatement) -> sql.Composed:
    # The unnamed statement, described: nothing is left in the session.
    pgconn = conn.pgconn
    prepared = pgconn.prepare(b"", hot.sql.encode())
    if prepared.status != ExecStatus.COMMAND_OK:
        raise RuntimeError(f"hot statement {hot.name.decode()} does not prepare:"
                           f" {(prepared.error_message or b'').decode(errors='replace')}")
    shape = pgconn.describe_prepared(b"")
    params = [shape.param_type(i) for i in range(shape.nparams)]
    columns = [shape.ftype(i) for i in range(shape.nfields)]
    if _VOID in columns:
        raise RuntimeError(f"hot statement {hot.name.decode()} returns a void column:"
                           " a function cannot (give it a type)")
    # Never prepared by psycopg: behind a pooler, its name could exist on the server session.
    types = [name for (name,) in conn.execute(TYPE_NAMES, (params + columns,), prepare=False)]
    # Type names as the server printed them, composed as SQL text (they are not identifiers:
    # `timestamp with time zone`, `uuid[]`).
    args = sql.SQL(", ").join(sql.SQL(t) for t in types[:len(params)])
    result: sql.Composable
    if columns:
        names = [(shape.fname(i) or b"").decode() for i in range(shape.nfields)]
        result = sql.SQL("TABLE ({})").format(sql.SQL(", ").join(
            sql.SQL("{} {}").format(sql.Identifier(n), sql.SQL(t))
            for n, t in zip(names, types[len(params):], strict=True)))
        body = RETURNING.format(hot.sql.strip().rstrip(";"))
    else:
        result = sql.SQL("void")
        body = PLAIN.format(hot.sql.strip().rstrip(";"))
    return CREATE.format(name=sql.Identifier(hot.function.decode()), args=args, result=result,
                         body=sql.Literal(body))


class Route:
    """How a worker's hot statements travel (runpool.trips.Via), shared by its claims and its
    outcome batches. "functions" turns into "pipeline" for good, in this process, once a trip
    fails as only missing, stale or forbidden functions fail (FunctionsUnusable): dropped by
    hand, or made for a schema a migration has changed since. The failed trip rolled back
    whole, and its caller sends the same work again the pipeline's way."""

    __slots__ = ("_log", "lacking", "via")

    def __init__(self, via: Via, log: dict[str, str] | None = None, *,
                 lacking: bool = False) -> None:
        self.via: Via = via
        self._log = log or {}
        # Behind a pooler, the functions were missing as the worker started: watch() turns
        # it to them once a migrate has made them.
        self.lacking = lacking

    async def watch(self, pool: AsyncConnectionPool, every: float) -> None:
        """While the functions are missing, look again every `every` seconds (a worker
        deployed before its `migrate`, a release whose hot statements changed without a
        migration); once they are all there, call them. Never raises: a failed look is
        tried again at the next."""
        while self.lacking:
            await asyncio.sleep(every)
            try:
                lacking = await _lacking(pool)
            except Exception as exc:
                logger.warning("looking for the hot functions failed: %r", exc,
                               extra={"action": "hot_functions_look_failed", **self._log})
                continue
            if not lacking:
                self.lacking = False
                self.via = "functions"
                logger.info("the hot functions are there now: this worker calls them",
                            extra={"action": "hot_functions_found", **self._log})

    def fall_back(self, exc: FunctionsUnusable) -> None:
        if self.via != "functions":
            return
        self.via = "pipeline"
        logger.error(
            "%s: this worker sends its statements themselves from now on (planned on every"
            " call, slower); run `python -m runpool migrate` with this version and restart"
            " it", exc, extra={"action": "hot_functions_unusable", **self._log})


async def route(pool: AsyncConnectionPool, *, stateless: bool, log: dict[str, str]) -> Route:
    """How a worker's hot statements travel on `pool`'s connections (`stateless`: through a
    transaction-mode pooler); without the functions, Route.watch waits for them."""
    if not stateless:
        return Route("prepared", log)
    lacking = await _lacking(pool)
    if lacking:
        logger.warning(
            "the database lacks %d of this runpool's hot functions (or this role may not"
            " execute them): behind the pooler each claim and outcome batch is planned on"
            " every call (slower) until `python -m runpool migrate` with this version makes"
            " them", lacking, extra={"action": "hot_functions_missing", "missing": lacking,
                                     **log})
        return Route("pipeline", log, lacking=True)
    return Route("functions", log)


async def _lacking(pool: AsyncConnectionPool) -> int:
    """How many of this runpool's hot functions this role cannot call."""
    names = [h.function.decode() for h in HOT_STATEMENTS]
    async with bounded(pool, 10) as conn:
        cur = await conn.execute(PRESENT, (names,))
        return len(names) - len(await cur.fetchall())
