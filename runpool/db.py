"""Connections: their options and session setup, error translation, and one-trip transactions."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import AsyncIterator
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import conninfo_to_dict

from .codec import configure
from .errors import DatabaseUnreachable, InvalidInput, UsageError, one_line

__all__ = [
    "CHECK_NAME",
    "DSN_SETTING",
    "LISTEN_DSN_SETTING",
    "READ_DSN_SETTING",
    "SET_LOCK_TIMEOUT",
    "application_name",
    "check_stateless",
    "connect",
    "connection_options",
    "named",
    "one_trip",
    "reach",
    "require_utf8",
    "set_up",
    "translate_error",
]


# Keepalives let the kernel notice a half-open idle connection (a peer that vanished) in
# ~30 s instead of two hours (Linux aborts on tcp_user_timeout once it is set, whatever
# keepalives_count says); tcp_user_timeout does the same for data sent and never
# acknowledged, which keepalives do not cover. A DSN's own keepalive settings win (TUNABLE).
KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 3,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,
    # runpool's JSON is UTF-8 bytes, sent as they are: under another client encoding (a
    # PGCLIENTENCODING=LATIN1 in a worker's environment, say) the server would read them as
    # that encoding and store mojibake. The server converts to the database's encoding.
    "client_encoding": "UTF8",
}
# The LISTEN connection waits idle by design, and a black-holed path (a dead NAT entry, a
# firewall dropping the flow) raises nothing on an idle socket: only keepalives notice it.
# At the pooled connections' pace that took ~31 s, while the host's wake-ups and cancel
# notices fell back to the poll and the heartbeat; probed this often it is noticed in at most
# ~10 s (small packets after 4 s of silence, no query, no transaction). The price: a path
# silent for more than ~4-6 s (a router's failover) costs the LISTEN connection a reconnect
# and each worker one catch-up claim.
LISTEN_KEEPALIVES: Final[dict[str, Any]] = {
    "keepalives_idle": 4,
    "keepalives_interval": 2,
    "keepalives_count": 3,
    "tcp_user_timeout": 10_000,
}
# The keepalive settings a DSN may set for itself (an operator on a flaky path relaxes them):
# a DSN that sets any of them has its own (libpq's defaults for the rest), not runpool's.
# client_encoding is not one of them: runpool's JSON is UTF-8.
TUNABLE: Final = frozenset({"keepalives", "keepalives_idle", "keepalives_interval",
                            "keepalives_count", "tcp_user_timeout"})
# Seconds a new connection may take to be established (psycopg's default is 130 s): one
# started while the network is silent (a listener's or a pool's reconnect) would otherwise
# hang for two minutes after the path heals. The DSN's (or PGCONNECT_TIMEOUT's) value wins.
CONNECT_TIMEOUT = 10


def _options(dsn: str, connect_timeout: int | None = None, *, listen: bool = False
             ) -> dict[str, Any]:
    """Keyword options of every runpool connection: keepalives (`listen`: a LISTEN
    connection's) and a bounded attempt; the DSN's own keepalive settings and connect_timeout
    win."""
    given = conninfo_to_dict(dsn)
    wanted = {**KEEPALIVES, **LISTEN_KEEPALIVES} if listen else KEEPALIVES
    # A DSN that tunes any of them tunes them all: runpool's tcp_user_timeout beside the
    # DSN's longer keepalives_idle would abort at the first unanswered probe.
    tuned = not TUNABLE.isdisjoint(given)
    options = {k: v for k, v in wanted.items() if not (tuned and k in TUNABLE)}
    if connect_timeout is None and ("connect_timeout" in given
                                    or os.environ.get("PGCONNECT_TIMEOUT")):
        return options
    return {**options, "connect_timeout": connect_timeout or CONNECT_TIMEOUT}


# The client encoding a caller's connection must have (under SQL_ASCII psycopg reads text
# columns as bytes: `wait` never saw b'succeeded' as a terminal status).
_UTF8_CLIENT: Final = ("UTF8",)


def require_utf8(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Refuse a caller's connection whose client encoding is not UTF-8: runpool sends its JSON
    as UTF-8 bytes and decodes what it reads as UTF-8, so under LATIN1, say, an input would be
    stored as mojibake and a result read back would not decode. (runpool's own connections
    are opened with client_encoding UTF8.)"""
    encoding = conn.info.parameter_status("client_encoding")
    if encoding is not None and encoding not in _UTF8_CLIENT:
        raise UsageError(f"runpool reads and writes UTF-8: this connection's client_encoding is"
                         f" {encoding} (connect with client_encoding=UTF8)")


def connection_options(dsn: str, connect_timeout: int | None = None) -> dict[str, Any]:
    """The keyword options every runpool connection is opened with (for pools, the worker's
    and the web app's): `connect_timeout` as in _options."""
    return _options(dsn, connect_timeout)



# Every runpool session, set up in the one round trip a new connection costs anyway:
# - read committed, whatever the database's default_transaction_isolation: the fenced writes
#   and the queue's statements are written for it (under repeatable read a checkpoint write
#   fails with a serialization error whenever the heartbeat touched the run row). Pinned per
#   session, not per transaction, so no statement pays for it. Behind PgBouncer in transaction
#   mode sessions are shared between clients: see STATELESS_OPTIONS for that case;
# - no JIT: the queue's statements are short index probes, and JIT compilation (which a cost
#   estimate on young statistics can trigger) would cost a hundred times the query.
SESSION_SETUP: Final = """
SELECT set_config('default_transaction_isolation', 'read committed', false),
       set_config('jit', 'off', false)
"""
# A pooled session (a worker's, its heartbeat's, an embedded pool's) also:
# - turns idle_session_timeout off: an operator sets it to reap forgotten sessions, and a
#   pool's are managed, not forgotten. A quiet pool's connections all go idle together; closed
#   by the server, every checkout would find a dead one (a claim or checkpoint fails, or waits
#   out psycopg_pool's reconnect backoff) and each replacement would idle past it again;
# - marks a worker's session: a worker that ends a run claims again at once, so releasing the
#   next run of a serial key from its session needs no doorbell;
# - plans its prepared statements once (psycopg prepares a statement on its fifth run): the
#   claim's statements are index probes whose shape no parameter changes, and planning them
#   anew each time cost more than running them (W1 2,000-2,300 -> 2,600-3,000 runs/s).
#   Functions that need plans per call say so in their own SET clause (see 0006);
# - never plans a sequential scan of a table it can read through an index. A generic plan is
#   made once, on the table as it is then, and kept until the table's statistics change: a
#   worker started on an empty queue planned its statements about given runs as a sequential
#   scan of a few pages, and kept scanning the whole table as it grew (where autovacuum's
#   ANALYZE does not come, or not yet: W11 on a server without it, every outcome batch read
#   all 5,000 runs, 3.6 ms; tests/test_worker_plans.py). A worker's statements read rows by
#   key or by an index's order; a table without an index is still scanned.
# Bound the lock waits of the rest of the current transaction (%(timeout)s: '2s', '150ms').
SET_LOCK_TIMEOUT: Final = "SELECT set_config('lock_timeout', %(timeout)s, true)"

WORKER_SESSION: Final = """
SELECT set_config('default_transaction_isolation', 'read committed', false),
       set_config('jit', 'off', false),
       set_config('idle_session_timeout', '0', false),
       set_config('runpool.session', 'worker', false),
       set_config('plan_cache_mode', 'force_generic_plan', false),
       set_config('enable_seqscan', 'off', false)
"""


def application_name(role: str) -> str:
    """`role@host`: what a runpool connection is called in pg_stat_activity (`status` counts
    connections per host by it). PostgreSQL keeps the first 63 bytes."""
    return f"{role}@{socket.gethostname()}"[:63]


# Behind a pooler in transaction mode (`stateless`), a session is not ours: a session SET
# would leak into whichever client the pooler hands the server session to next, and a prepared
# statement would be missing on the next server session (PgBouncer before 1.21 does not track
# them; Debian 12 ships 1.18). So such connections prepare nothing and set nothing; explicit
# transactions say their isolation level in their BEGIN, and single statements rely on the
# database's default, which `check_stateless` verifies once at start. JIT stays as the
# database has it (turn it off for the role: ALTER ROLE ... SET jit = off).
STATELESS_OPTIONS: Final[dict[str, Any]] = {"prepare_threshold": None}
# The first statement of runpool's hot transactions (the claim's, the outcome batch's): JIT
# off for the transaction. A stateless connection cannot turn it off for its session, and a
# claim whose estimate crosses jit_above_cost (young statistics, a deep queue) compiled its
# plan every time: W1 through PgBouncer drained 14 runs/s with JIT on against 540 off. Sent in
# the transaction's pipeline, it costs no round trip; on a session that has JIT off already
# it changes nothing.
NO_JIT: Final = "SELECT set_config('jit', 'off', true)"
# Read through the pooler at start (see check_stateless).
DEFAULT_ISOLATION: Final = "SELECT current_setting('default_transaction_isolation')"


def named(dsn: str, extra: dict[str, Any], name: str | None) -> dict[str, Any]:
    """`extra` with application_name `name`, unless the DSN names the connection itself."""
    if name is not None and "application_name" not in conninfo_to_dict(dsn):
        return {**extra, "application_name": name}
    return extra


def connect(dsn: str, *, autocommit: bool = False, stateless: bool = False,
            name: str | None = None) -> psycopg.Connection[Any]:
    """A runpool connection (`stateless`: one that may go through a transaction-mode pooler;
    `name`: its application_name, unless the DSN has one)."""
    extra = named(dsn, STATELESS_OPTIONS if stateless else {}, name)
    conn = psycopg.connect(dsn, autocommit=True, **_options(dsn), **extra)
    configure(conn)
    if stateless:
        conn.isolation_level = psycopg.IsolationLevel.READ_COMMITTED
    else:
        conn.execute(SESSION_SETUP)
    conn.autocommit = autocommit
    return conn


# The settings a DSN comes from, as reach() names them: as a Pool's argument and as the
# environment variable.
DSN_SETTING: Final = "dsn (RUNPOOL_DSN)"
LISTEN_DSN_SETTING: Final = "listen_dsn (RUNPOOL_LISTEN_DSN)"
READ_DSN_SETTING: Final = "read_dsn (RUNPOOL_READ_DSN)"


def reach(dsn: str, setting: str, *, stateless: bool = False, name: str | None = None
          ) -> psycopg.Connection[Any]:
    """connect() in autocommit, for a check at start or a command: a connection that cannot be
    made at all (refused, timed out, no such database or role, a password) raises
    DatabaseUnreachable, naming the setting whose DSN it was (`setting`) and PostgreSQL's
    reason, on one line."""
    try:
        return connect(dsn, autocommit=True, stateless=stateless, name=name)
    except psycopg.OperationalError as exc:
        raise DatabaseUnreachable(f"{setting} cannot be connected to: {one_line(exc)}"
                                  ) from exc


async def set_up(conn: psycopg.AsyncConnection[Any]) -> None:
    """A pool's new session in autocommit, set up as every runpool connection: the codec and
    SESSION_SETUP (the web app's pools and a FollowHub's readers)."""
    configure(conn)
    await conn.set_autocommit(True)
    await conn.execute(SESSION_SETUP)


async def aconnect(dsn: str, *, autocommit: bool = False, stateless: bool = False,
                   name: str | None = None, listen: bool = False
                   ) -> psycopg.AsyncConnection[Any]:
    """An async runpool connection; `name`: its application_name, unless the DSN has one;
    `listen`: a LISTEN connection (LISTEN_KEEPALIVES)."""
    extra = named(dsn, STATELESS_OPTIONS if stateless else {}, name)
    conn = await psycopg.AsyncConnection.connect(dsn, autocommit=True,
                                                 **_options(dsn, listen=listen), **extra)
    configure(conn)
    if stateless:
        await conn.set_isolation_level(psycopg.IsolationLevel.READ_COMMITTED)
    else:
        await conn.execute(SESSION_SETUP)
    await conn.set_autocommit(autocommit)
    return conn


# The application_name (before "@host") of the short direct connection that checks a LISTEN
# DSN when a pool starts behind a pooler: the one server connection besides the LISTEN
# connection that a pooled host opens directly, named so that it can be told apart.
CHECK_NAME: Final = "runpool-check"
# Which database of which server (run) a connection reached: the LISTEN DSN must reach the
# one the work DSN does, or no doorbell would ever ring.
WHICH_DATABASE: Final = "SELECT current_database(), pg_postmaster_start_time()"


def check_stateless(conn: psycopg.Connection[Any], listen_dsn: str) -> None:
    """Refuse a database whose single statements would not run read committed (a stateless
    connection cannot pin the level for its session, see STATELESS_OPTIONS), and a LISTEN
    DSN that reaches another database than `conn`'s."""
    with reach(listen_dsn, LISTEN_DSN_SETTING, name=application_name(CHECK_NAME)) as direct:
        listening = direct.execute(WHICH_DATABASE).fetchone()
    working = conn.execute(WHICH_DATABASE).fetchone()
    if listening != working:
        raise UsageError(
            "RUNPOOL_LISTEN_DSN reaches another database than RUNPOOL_DSN"
            f" ({listening!r} against {working!r}: database, server start time): it must"
            " name the same database, directly")
    row = conn.execute(DEFAULT_ISOLATION).fetchone()
    level = row[0] if row else None
    if level != "read committed":
        raise UsageError(
            f"the database's default_transaction_isolation is {level!r}: behind a pooler"
            " (RUNPOOL_LISTEN_DSN set) runpool's single statements run at the database's"
            " default, and they need 'read committed' (ALTER DATABASE ... SET"
            " default_transaction_isolation = 'read committed', or the role's)")


def translate_error(exc: psycopg.Error) -> Exception:
    """Turn the database's refusal of bad input into InvalidInput; pass anything else through."""
    if isinstance(
        exc,
        pg_errors.InvalidParameterValue
        | pg_errors.ProgramLimitExceeded
        | pg_errors.InvalidTextRepresentation
        | pg_errors.UntranslatableCharacter
        | pg_errors.CheckViolation
        | pg_errors.StringDataRightTruncation,
    ):
        diag = exc.diag.message_primary or str(exc)
        return InvalidInput(diag)
    if isinstance(exc, psycopg.DataError) and "NUL" in str(exc):
        return InvalidInput("text contains a NUL (0x00) character, which PostgreSQL rejects")
    return exc


# A transaction's bounds, sent as plain statements in one_trip's pipeline. Read committed is
# named, as every explicit transaction of a stateless (pooled-through-PgBouncer) connection
# does: there no session pins the level, and the claim is written for read committed.
BEGIN: Final = "BEGIN ISOLATION LEVEL READ COMMITTED"
COMMIT: Final = "COMMIT"
ROLLBACK: Final = "ROLLBACK"


@contextlib.asynccontextmanager
async def one_trip(conn: psycopg.AsyncConnection[Any], *, pinned: bool = False
                   ) -> AsyncIterator[None]:
    """A pipelined transaction whose statements (none of them read before the end) cost one
    round trip: BEGIN, the body and COMMIT behind one Sync. psycopg's transaction() in a
    pipeline syncs at BEGIN and at COMMIT, and its pipeline once more on exit: four round
    trips for a claim. Needs an autocommit connection (the pool's); on any other it falls
    back to transaction(). On an error the server has skipped the rest, COMMIT included, and
    holds a failed transaction: it is rolled back here (or the connection is gone).

    `pinned`: the session pins read committed (WORKER_SESSION), so the body goes without BEGIN
    and COMMIT, as the implicit transaction the server keeps open until the pipeline's Sync
    and commits there: two statements fewer, each a psycopg execute with its own flush and
    poll (~10 us of CPU). The Sync must then never follow a body that did not finish: an
    exception in the body closes the connection instead, and the server rolls back what it
    was sent (a transaction its client never synced). (runpool's own worker-session trips
    now go as one simple query of prepared statements instead, see runpool.trips.)"""
    if not conn.autocommit:
        async with conn.pipeline(), conn.transaction():
            yield
        return
    try:
        async with conn.pipeline():
            if not pinned:
                await conn.execute(BEGIN)
            try:
                yield
            except BaseException:
                if pinned:
                    conn.pgconn.finish()
                raise
            if not pinned:
                await conn.execute(COMMIT)
    except BaseException:
        if not conn.closed and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            with contextlib.suppress(psycopg.Error):
                await conn.execute(ROLLBACK)
        raise
