"""A worker's hot trips as ONE simple-protocol query: `EXECUTE name(literal, ...);` for each
statement, of statements the session prepared once (PREPARE name AS ...); or, behind a
transaction-mode pooler, `SELECT * FROM runpool.hot_name_hash(literal, ...);` of the same
statements installed as PL/pgSQL functions (runpool.pooled), whose plans the server keeps.

Why: psycopg's pipeline costs ~35-55 us of client CPU per statement (a Parse/Bind/Execute,
parameter dumping and a result round each); an outcome batch with its refill is up to eleven.
One string of quoted literals costs one send and one parse of the answers (callgrind, W1's
batch of 10 with its refill, the whole client: 2.26 M -> 1.81 M instructions). A group
commit's batch of checkpoint writes (runpool.commits) goes the same way: its batch statements
(BATCHES) take the writes as one JSON literal.

Semantics are the pinned pipeline's (db.one_trip, pinned=True): a multi-statement simple query
in autocommit is one implicit transaction, so an error skips the rest and rolls it all back,
and nothing is sent before send(). Prepared statements only on worker sessions
(db.WORKER_SESSION): behind a transaction-mode pooler the session is not ours, so a trip
there calls the functions, and sets what a worker session pins for its own transaction only.
"""

from __future__ import annotations

import hashlib
import re
import uuid
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal, LiteralString, Protocol

import orjson
import psycopg
from psycopg import errors as pg_errors
from psycopg.adapt import Buffer, Loader
from psycopg.types.json import Jsonb

from checkpoints.batch_sql import BATCH_FINISH, BATCH_INTENT, BATCH_MESSAGE

from .migration_files import latest_version
from .queries import QUERIES

__all__ = ["BATCHES", "HOT", "HOT_STATEMENTS", "Answer", "FunctionsUnusable", "HotStatement",
           "JsonText", "Rows", "Trip", "Via", "prepared_sql"]

# The statements a trip runs prepared: the outcome batch's and the claim's.
HOT: Final = ("finish_runs", "defer_serial_release", "lock_ended_serial_keys",
              "release_serial_keys", "reap_expired", "expire_deadlines", "heal_serial_keys",
              "schedule_probe", "touch_worker", "promote_due", "wake_due", "lock_tenants",
              "claim_runs")


class Rows(Protocol):
    """A statement's answer, read after its transaction ended: a cursor, or a trip's Answer."""

    async def fetchone(self) -> Any: ...

    async def fetchall(self) -> list[Any]: ...


class JsonText(Loader):
    """jsonb as its JSON text, undecoded. One claim carries runs of many tenants: a value
    one of them crafted must fail that run alone, in its slot, never the claim (which would
    kill the worker after the claim committed, and strand every run beside it)."""

    def load(self, data: Buffer) -> bytes:
        return bytes(data)


# How a worker's hot statements travel: a trip of the session's prepared statements (a worker
# session), a trip of calls to their functions (behind a pooler, runpool.pooled), or psycopg's
# pipeline of the statements themselves (any connection; behind a pooler whose database lacks
# this runpool's functions, planned on every call).
Via = Literal["prepared", "functions", "pipeline"]


@dataclass(frozen=True, slots=True)
class HotStatement:
    name: bytes  # a fixed identifier: runpool_ and the statement's name in queries.sql
    params: tuple[str, ...]  # the %(name)s parameters, in $n order
    sql: str  # the statement with $n placeholders
    # Its function's name (in schema runpool): hot_, the name and a digest of `sql` and of the
    # schema's version (which gives the function its column types): a fleet mixing versions
    # calls, for each version, the statement that version holds, on the schema it was made on.
    function: bytes


_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%|%s")


def prepared_sql(query: str) -> tuple[str, tuple[str, ...]]:
    """A psycopg-style statement (`%(name)s` placeholders) as PREPARE takes it (`$n`), and
    the parameters' names in $n order (a name used twice is one parameter)."""
    order: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(0) == "%%":
            return "%"
        if (name := match.group(1)) is None:
            raise ValueError("positional %s placeholders cannot be prepared by name")
        if name not in order:
            order.append(name)
        return f"${order.index(name) + 1}"

    return _PLACEHOLDER.sub(number, query), tuple(order)


# The schema's version the hot functions are made for (see HotStatement.function).
_SCHEMA: Final = latest_version()


def _prepared(name: str, query: str) -> HotStatement:
    sql, params = prepared_sql(query)
    digest = hashlib.sha256(f"{_SCHEMA}\n{sql}".encode()).hexdigest()[:12]
    return HotStatement(f"runpool_{name}".encode(), params, sql,
                        f"hot_{name}_{digest}".encode())


# The checkpoint writes' batch statements (a worker's group commit, runpool.commits), by name.
BATCHES: Final = {"batch_message": BATCH_MESSAGE, "batch_intent": BATCH_INTENT,
                  "batch_finish": BATCH_FINISH}
# By the statement's text, as the callers hold it (the modules' own strings: their hash is
# cached and the lookup meets the same object, so finding a 3k-character statement costs
# nothing).
_HOT: Final[dict[str, HotStatement]] = {QUERIES[n]: _prepared(n, QUERIES[n]) for n in HOT}
# The batch statements, prepared apart, by the first trip that sends one: a session that
# prepared them as it opened would wait there for any lock on messages or tool_calls (an
# operator's ALTER TABLE), and with it the worker's claims and heartbeats.
_BATCHES: Final[dict[str, HotStatement]] = {
    query: _prepared(n, query) for n, query in BATCHES.items()}
_BY_TEXT: Final[dict[str, HotStatement]] = {**_HOT, **_BATCHES}
# Every statement a trip runs by name, each with its function (runpool.pooled makes them):
# the claim's and the outcome batch's, and a group commit's batch statements.
HOT_STATEMENTS: Final[tuple[HotStatement, ...]] = tuple(_BY_TEXT.values())
_TUPLES_OK: Final = psycopg.pq.ExecStatus.TUPLES_OK
_LIST_OURS: Final = "SELECT name FROM pg_prepared_statements WHERE name = ANY(%s)"
# A functions trip's first statements: for its transaction only, what a worker session pins
# for itself (db.WORKER_SESSION) and the hot statements rely on. Read committed first (the
# server session is the pooler's, and any client of it may have SET another default since
# db.check_stateless looked); JIT off (a claim's estimate past jit_above_cost compiled its
# plan on every call); the generic plan, made once per server session (its plan for an
# empty queue, enable_seqscan off, stays good for a deep one).
_FUNCTIONS_SETTINGS: Final = (
    b"SET TRANSACTION ISOLATION LEVEL READ COMMITTED, READ WRITE",
    b"SELECT set_config('jit', 'off', true), set_config('plan_cache_mode', 'force_generic_plan',"
    b" true), set_config('enable_seqscan', 'off', true)")
# What a functions trip fails with when the functions are not this runpool's to call: gone
# (dropped), made for another schema (a migration changed a column's type since), or not
# the worker's to execute (see FunctionsUnusable); _about_functions tells it from the same
# SQLSTATE raised by anything else in the trip.
_UNUSABLE: Final = (pg_errors.UndefinedFunction, pg_errors.DatatypeMismatch,
                    pg_errors.InsufficientPrivilege)
# RETURN QUERY's words for a result whose columns no longer match the function's.
_STALE: Final = "structure of query does not match function result type"

# Sessions that prepared the statements. Weak: a connection the pool dropped takes its entry
# with it, and a new one (after a restart, say) prepares again.
_sessions: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()
# The literals' encoding: every connection runpool opens says client_encoding UTF8
# (db.KEEPALIVES), whatever the environment, the DSN or the database's settings say.
_ENCODING: Final = "utf-8"
# Sessions that prepared the batch statements too.
_batch_sessions: weakref.WeakSet[psycopg.AsyncConnection[Any]] = weakref.WeakSet()


class FunctionsUnusable(Exception):
    """A functions trip failed as only missing, stale or forbidden functions fail; its
    implicit transaction rolled back whole (runpool.pooled.Route falls back for good)."""

    def __init__(self, cause: psycopg.Error) -> None:
        super().__init__(f"the hot functions cannot serve this runpool: {cause.sqlstate}"
                         f" {cause.diag.message_primary}")
        self.cause = cause


class Answer:
    """A statement's rows in a trip, there once it was sent ([]: a statement without rows).
    Filled by Trip.send, hence not frozen."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: list[Any] | None = None

    async def fetchall(self) -> list[Any]:
        if self._rows is None:
            raise psycopg.ProgrammingError("the trip was not sent: no answer yet")
        return self._rows

    async def fetchone(self) -> Any:
        rows = await self.fetchall()
        return rows[0] if rows else None


class Trip:
    """Statements queued by execute() (the same call as a connection's, so claim_statements
    serves both), sent as one simple query by send(). jsonb columns come back as JSON text
    (JsonText): the claim's inputs are decoded in each run's slot."""

    __slots__ = ("_answers", "_batches", "_escaping", "_functions", "_parts", "connection")

    def __init__(self, conn: psycopg.AsyncConnection[Any], *, functions: bool = False) -> None:
        """`functions`: call the hot statements' functions (Via "functions") instead of the
        session's prepared statements."""
        if not conn.autocommit:
            # Its implicit transaction is what makes the trip all-or-nothing.
            raise psycopg.ProgrammingError("a trip needs an autocommit connection")
        self.connection = conn
        # libpq's quoting, for the connection's encoding and settings.
        self._escaping = psycopg.pq.Escaping(conn.pgconn)
        self._parts: list[bytes] = []
        self._answers: list[Answer] = []
        # Whether a batch statement is among them (prepared apart, see _BATCHES).
        self._batches = False
        self._functions = functions
        if functions:
            for setting in _FUNCTIONS_SETTINGS:
                self._parts.append(setting)
                self._answers.append(Answer())

    async def execute(self, query: LiteralString, params: Mapping[str, Any] | None = None
                      ) -> Answer:
        """Queue a statement: a hot one (HOT, BATCHES) by its prepared name, any other only
        without parameters (as its text, a single statement)."""
        prepared = _BY_TEXT.get(query)
        if prepared is None:
            if params:
                raise psycopg.ProgrammingError("a trip takes parameters for HOT statements only")
            self._parts.append(query.encode(_ENCODING))
        elif self._functions:
            assert params is not None or not prepared.params
            self._parts.append(b"SELECT * FROM runpool.%b(%b)" % (prepared.function, b",".join(
                [self._literal(params[p]) for p in prepared.params] if params else [])))
        elif prepared.params:
            assert params is not None
            self._batches = self._batches or query in _BATCHES
            self._parts.append(b"EXECUTE %b(%b)" % (prepared.name, b",".join(
                [self._literal(params[p]) for p in prepared.params])))
        else:
            self._parts.append(b"EXECUTE " + prepared.name)
        answer = Answer()
        self._answers.append(answer)
        return answer

    def _literal(self, value: Any) -> bytes:
        """A value as a quoted SQL literal, by libpq (whatever standard_conforming_strings
        says); untyped, so the prepared parameter's type parses it, as it would a parameter."""
        if value is None:
            return b"NULL"
        if isinstance(value, Jsonb):
            return self._json_literal(value)
        text = _text(value)
        if "\x00" in text:
            # libpq's escaping stops at a NUL: the value would arrive cut short.
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return self._escaping.escape_literal(text.encode(_ENCODING))

    def _json_literal(self, value: Jsonb) -> bytes:
        """A Jsonb parameter's JSON text as a literal: encoded by its own dumps (a batch's
        rows come as the bytes the callers encoded, never encoded again), else by orjson.
        Bytes go as they are, as psycopg's Jsonb dumper sends them."""
        data = value.dumps(value.obj) if value.dumps is not None else orjson.dumps(value.obj)
        if isinstance(data, str):
            data = data.encode(_ENCODING)
        data = bytes(data)
        if b"\x00" in data:
            raise psycopg.DataError("PostgreSQL text fields cannot contain NUL (0x00) bytes")
        return self._escaping.escape_literal(data)

    async def send(self) -> None:
        """Send the queued statements as one query and read every answer. A session whose
        statements vanished (DISCARD ALL, DEALLOCATE) prepares them again and sends once more:
        the error rolled the whole query back."""
        if not self._answers:
            return
        conn = self.connection
        if self._functions:
            try:
                await self._send(b";\n".join(self._parts))
            except _UNUSABLE as exc:
                if not _about_functions(exc):
                    raise
                raise FunctionsUnusable(exc) from exc
            return
        if conn not in _sessions:
            await _prepare(conn, _HOT)
            _sessions.add(conn)
        if self._batches and conn not in _batch_sessions:
            await _prepare(conn, _BATCHES)
            _batch_sessions.add(conn)
        query = b";\n".join(self._parts)
        try:
            await self._send(query)
        except pg_errors.InvalidSqlStatementName:
            await _prepare(conn, _BY_TEXT if self._batches else _HOT)
            await self._send(query)

    async def _send(self, query: bytes) -> None:
        cur = self.connection.cursor()
        cur.adapters.register_loader("jsonb", JsonText)
        # No parameters, text results, not in a pipeline, prepare=False: psycopg sends it with
        # the simple protocol (PQsendQuery), which runs several statements. prepare=False does
        # not keep psycopg from counting a query of one result in its per-connection cache of
        # strings: a trip of one statement (a lone write's, its JSON inline) would stay there,
        # up to 100 distinct strings of up to ~0.5 MB a connection, and push the statements
        # it should prepare out of it (attack15). With no threshold it neither counts nor looks.
        conn = self.connection
        threshold = conn.prepare_threshold
        conn.prepare_threshold = None
        try:
            await cur.execute(query, prepare=False)
        finally:
            conn.prepare_threshold = threshold
        last = len(self._answers) - 1
        for i, answer in enumerate(self._answers):
            # (The result's status, not cur.description: that builds a Column per column of
            # every result, ~40 us for the claim's.)
            result = cur.pgresult
            answer._rows = (await cur.fetchall() if result is not None
                            and result.status == _TUPLES_OK else [])
            if (cur.nextset() is None) != (i == last):
                raise psycopg.ProgrammingError(
                    "a trip's statement answered more or fewer than one result")


def _about_functions(exc: psycopg.Error) -> bool:
    """Whether the error is about a hot function itself: one missing or not ours to execute
    (the trip's own call failed: no context, and the message names a hot function), or one
    whose result no longer matches (RETURN QUERY's error, raised by a hot function's body
    itself). Not the same SQLSTATE from deeper down (an operator's trigger on a table the
    statements write, whose message may quote a tenant's text)."""
    message, context = exc.diag.message_primary or "", exc.diag.context
    if isinstance(exc, pg_errors.DatatypeMismatch):
        # Innermost first: the hot statement itself (SPI's line, its text quoted, newlines
        # and all), then the one line of its function's RETURN QUERY; nothing deeper.
        statement, _, function = (context or "").rpartition("\n")
        return (message == _STALE and statement.startswith('SQL statement "')
                and function.startswith("PL/pgSQL function runpool.hot_")
                and function.endswith("at RETURN QUERY"))
    return context is None and "hot_" in message


# Types whose str() is their input text, and those sent as arrays (tuples named once: an
# `int | float` in isinstance builds a union object on every call).
_PLAIN: Final = (int, float, uuid.UUID)
_ARRAYS: Final = (list, tuple)


def _text(value: Any) -> str:
    """The text PostgreSQL's input function for the parameter's type reads."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "t" if value else "f"
    if isinstance(value, _PLAIN):
        return str(value)
    if isinstance(value, _ARRAYS):
        return "{" + ",".join([_element(v) for v in value]) + "}"
    raise TypeError(f"a trip cannot send a {type(value).__name__} parameter")


def _element(value: Any) -> str:
    """An array literal's element: quoted, its quotes and backslashes escaped (array syntax,
    read by array_in after the SQL literal was: not SQL quoting); NULL for None."""
    if value is None:
        return "NULL"
    if isinstance(value, _ARRAYS):  # quoted, it would arrive as text, not as a sub-array
        raise TypeError("a trip cannot send nested arrays")
    return '"' + _text(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


async def _prepare(conn: psycopg.AsyncConnection[Any], which: dict[str, HotStatement]) -> None:
    """Prepare those of `which` the session lacks (all on a new session, after DISCARD ALL
    all, after a DEALLOCATE that one). Asked, not assumed: a PREPARE whose answer was lost
    (its task cancelled) may have run, and a second would fail."""
    names = [p.name.decode() for p in which.values()]
    cur = await conn.execute(_LIST_OURS, (names,))
    have = {name for (name,) in await cur.fetchall()}
    # Fixed names and the modules' static text: no user data in this string.
    prepare = ";\n".join(f"PREPARE {p.name.decode()} AS {p.sql}"
                         for p in which.values() if p.name.decode() not in have)
    if prepare:
        await conn.execute(prepare.encode(), prepare=False)
