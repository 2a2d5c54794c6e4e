"""`python -m runpool`: run the pool (`worker`, the default command), or one of its other
subcommands. Every settings flag has a RUNPOOL_* twin.

Exit codes: 0 ok, 1 not found or failed (`wait`: the run failed or was cancelled), 2 invalid
input, 3 `wait` timed out, 78 cannot run here as configured (the app cannot be loaded, or a
worker found the schema out of date).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from datetime import datetime
from typing import Any

import psycopg

from . import __version__, faults, otel_setup
from .db import (
    DSN_SETTING,
    LISTEN_DSN_SETTING,
    READ_DSN_SETTING,
    connect,
    reach,
    translate_error,
)
from .embedded import resolve_dsn
from .errors import AppNotFound, InvalidInput, RunpoolError
from .exits import EXIT_CONFIG
from .logs import setup_logging
from .queue_cli import run_command
from .settings import Settings

__all__ = ["main"]

# `run` is the pool command's older name, still accepted.
POOL_COMMANDS = ("worker", "run")
COMMANDS = (
    *POOL_COMMANDS, "migrate", "enqueue", "cancel", "retry", "resolve", "signal", "explain",
    "runs", "wait", "status", "schedules", "demo", "bench", "ui",
)

_HELP = {
    "dsn": "PostgreSQL DSN (else DATABASE_URL, else an embedded server)",
    "app": "the handler registry to load, module:attribute",
    "workers": "worker processes (default: CPU count, at most 4)",
    "concurrency": "run slots per worker process",
    "lease_seconds": "lease length; heartbeats every third of it",
    "poll_seconds": "fallback poll interval when no NOTIFY arrives",
    "grace_seconds": "how long a draining worker lets in-flight runs finish",
    "max_attempts": "default attempts per run (written to runpool.config)",
    "retry_backoff_seconds": "base of the exponential retry backoff",
    "tenant_quota": "default quota for tenants without one (written to runpool.config)",
    "aging_seconds": "seconds of waiting worth one priority point (runpool.config)",
    "cancel_grace_seconds": "how long a cancelled handler may clean up",
    "max_input_bytes": "largest accepted run input (runpool.config)",
    "max_message_bytes": "largest message or tool result a handler may commit",
    "max_result_bytes": "largest result a handler may end a run with",
    "pool_size": "database connections per worker (default 3 + concurrency/4)",
    "listen": "use LISTEN/NOTIFY (--no-listen: poll only)",
    "listen_dsn": "the LISTEN connection's DSN, direct to PostgreSQL: --dsn may then name a"
                  " transaction-mode pooler (work connections keep no session state)",
    "read_dsn": "a read replica's DSN for status, schedules, runs RUN_ID, explain and the"
                " console's pages (they may lag behind --dsn by the replica's delay)",
    "host_connections": "most work connections of this host's workers together (default:"
                        " workers x (pool size + 1))",
    "data_dir": "embedded PostgreSQL data directory",
    "schedule_catchup_max": "most missed plans of one schedule catch_up='all' fires",
    "retention_seconds": "purge finished runs older than this (0 keeps everything)",
    "alert_webhook": "URL every run entering 'failed' is posted to (JSON, Slack-compatible)",
}


def _add_settings_flags(parser: argparse.ArgumentParser, only: tuple[str, ...] = ()) -> None:
    for f in fields(Settings):
        if only and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-").removesuffix("-seconds")
        help_text = f"{_HELP.get(f.name, '')} [RUNPOOL_{f.name.upper()}]"
        type_name = str(f.type)
        if type_name.startswith("bool"):
            # --listen / --no-listen; neither given: the environment or the default decides.
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction,
                                default=None, help=help_text)
            continue
        kind: Any = str
        if type_name.startswith("int"):
            kind = int
        elif type_name.startswith("float"):
            kind = float
        parser.add_argument(flag, dest=f.name, type=kind, default=None, help=help_text)


def _settings(args: argparse.Namespace) -> Settings:
    overrides = {f.name: getattr(args, f.name, None) for f in fields(Settings)}
    return Settings.from_env(**overrides)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m runpool", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"runpool {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    db_only = ("dsn", "data_dir", "listen_dsn", "read_dsn")

    p = sub.add_parser(
        "worker", aliases=["run"], help="run the worker pool (the default command)",
        description="Run the worker pool: a supervisor forking --workers processes of"
                    " --concurrency run slots each, loading handlers from --app.")
    _add_settings_flags(p)

    p = sub.add_parser("migrate", help="apply pending migrations")
    _add_settings_flags(p, db_only)
    p.add_argument("--sql", action="store_true", help="print the pending SQL instead")

    p = sub.add_parser("enqueue", help="enqueue one run; prints its id")
    _add_settings_flags(p, db_only)
    p.add_argument("tenant")
    p.add_argument("handler")
    p.add_argument("--input", default="{}", help="JSON input (default {})")
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--idempotency-key")
    p.add_argument("--run-at", type=datetime.fromisoformat, help="ISO 8601 time")
    p.add_argument("--max-attempts", type=int)
    p.add_argument("--serial-key", help="runs sharing a serial key run one at a time, in order")
    p.add_argument("--timeout", type=float,
                   help="seconds one attempt may run (past it: failed, reason timeout, retried)")
    p.add_argument("--deadline", type=datetime.fromisoformat,
                   help="ISO 8601 time the run must end by (past it: deadline_exceeded)")
    p.add_argument("--budget", help='JSON, e.g. {"max_tokens": 100000, "max_cost": 2.5,'
                                    ' "max_tool_calls": 50, "max_turns": 20}')

    p = sub.add_parser("cancel", help="cancel a run (runpool.cancel_run)")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("--reason")
    p.add_argument("--tenant")

    p = sub.add_parser("retry", help="put a failed or cancelled run back in the queue")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")

    p = sub.add_parser("resolve", help="resolve a tool call of a run that is not running"
                       " (runpool.resolve_tool_call), then `retry` the run")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("call_id")
    how = p.add_mutually_exclusive_group(required=True)
    how.add_argument("--result", help="it was done: this JSON is the call's result")
    how.add_argument("--retry", action="store_true", help="run the tool again")
    p.add_argument("--tenant")

    p = sub.add_parser("signal", help="send a signal to a run (runpool.signal_run): a run"
                       " waiting for it continues; else it is kept until the run waits")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("name")
    p.add_argument("--payload", default="{}", help="JSON (default {})")
    p.add_argument("--tenant")

    p = sub.add_parser("explain", help="why a run is (not) running")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true", help="print the JSON document")

    p = sub.add_parser("runs", help="one run's history: events, messages, tool calls")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true",
                   help="print one JSON document (with --follow: one per event)")
    p.add_argument("--follow", action="store_true",
                   help="print the run's events as they happen; exit after its end")
    p.add_argument("--after", type=int, default=0, help="with --follow: the last seq seen")

    p = sub.add_parser("wait", help="wait for a run to end (exit 0 succeeded, 1 failed or"
                                    " cancelled, 3 timed out)")
    _add_settings_flags(p, db_only)
    p.add_argument("run_id")
    p.add_argument("--timeout", type=float, default=None, help="seconds (default: no limit)")
    p.add_argument("--json", action="store_true", help="print the RunResult as JSON")

    p = sub.add_parser("status", help="counts, in-flight and stuck runs, failures, workers")
    _add_settings_flags(p, db_only)
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None,
                   metavar="SECONDS", help="refresh in place every SECONDS (default 2)")
    p.add_argument("--window", type=float, default=3600,
                   help="seconds of finished runs the percentiles cover (default 3600)")
    p.add_argument("--xmin-warn", type=float, default=60.0, metavar="SECONDS",
                   help="warn about a snapshot (xmin) held longer than this (default 60)")

    p = sub.add_parser("schedules", help="every schedule, with its next fire times")
    _add_settings_flags(p, db_only)
    p.add_argument("--json", action="store_true", help="print one JSON document")

    p = sub.add_parser("ui", help="serve the web console, the run API and /metrics",
                       description="Serve runpool.web's operator console (every tenant: keep it"
                                   " to operators; it binds 127.0.0.1 unless told otherwise).")
    _add_settings_flags(p, db_only)
    p.add_argument("--host", default=os.environ.get("RUNPOOL_UI_HOST", "127.0.0.1"),
                   help="address to bind (default 127.0.0.1) [RUNPOOL_UI_HOST]")
    p.add_argument("--port", type=int, default=int(os.environ.get("RUNPOOL_UI_PORT", "8080")),
                   help="port (default 8080) [RUNPOOL_UI_PORT]")
    p.add_argument("--header-timeout", type=float, metavar="SECONDS",
                   default=os.environ.get("RUNPOOL_UI_HEADER_TIMEOUT"),
                   help="drop a connection that has not sent a request's head in this time"
                        " (default 10) [RUNPOOL_UI_HEADER_TIMEOUT]")
    p.add_argument("--max-connections", type=int,
                   default=os.environ.get("RUNPOOL_UI_MAX_CONNECTIONS"),
                   help="connections held at once; one more is answered 503 (default 500)"
                        " [RUNPOOL_UI_MAX_CONNECTIONS]")

    p = sub.add_parser("demo", help="run the sample agent app on a pool and watch it")
    _add_settings_flags(p, db_only)
    p.add_argument("--runs", type=int, default=36)

    p = sub.add_parser("bench", help="run benchmarks; one JSON line per workload")
    _add_settings_flags(p, db_only)
    p.add_argument("--workload", nargs="+", default=None, help="W1 W2 W3 W5 W6")
    p.add_argument("--repeat", type=int, default=1, help="runs per workload (median reported)")
    p.add_argument("--soak", type=float, metavar="MINUTES", default=None,
                   help="instead: soak a pool under random faults, then check every invariant")
    p.add_argument("--seed", type=int, default=None, help="the soak's random seed")
    p.add_argument("--bloat", action="store_true",
                   help="with --soak: the long-lived mode (retention, sizes, claim latency)")
    p.add_argument("--retention", type=float, default=60.0, metavar="SECONDS",
                   help="--bloat: the pool's retention (default 60)")
    p.add_argument("--every", type=float, default=60.0, metavar="SECONDS",
                   help="--bloat: seconds between two report lines (default 60)")
    p.add_argument("--pin-xmin", type=float, default=0.0, metavar="SECONDS",
                   help="--bloat: hold a snapshot open this long from a third of the way in")
    p.add_argument("--pin-at", type=float, default=None, metavar="SECONDS",
                   help="--bloat: start the pinned snapshot this many seconds in instead")
    p.add_argument("--max-runs", type=int, default=None, help="--bloat: stop after this many")
    p.add_argument("--min-runs", type=int, default=0,
                   help="--soak: go on past MINUTES until this many runs were enqueued")
    p.add_argument("--plot", metavar="PATH", help="--bloat: write the curves (PNG and CSV)")
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in {*COMMANDS, "-h", "--help", "--version"}:
        argv.insert(0, "worker")
    args = _parser().parse_args(argv)
    try:
        setup_logging()
        code = _dispatch(args)
    except InvalidInput as exc:
        print(f"runpool: invalid input: {exc}", file=sys.stderr)
        code = 2
    except AppNotFound as exc:
        print(f"runpool: {exc}", file=sys.stderr)
        code = EXIT_CONFIG
    except RunpoolError as exc:
        print(f"runpool: {exc}", file=sys.stderr)
        code = 1
    sys.exit(code)


def _dispatch(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if args.command in POOL_COMMANDS:
        return _run(settings)
    if args.command == "demo":
        from .harness.demo import run_demo

        return run_demo(settings, runs=args.runs)
    if args.command == "bench" and args.soak is not None and args.bloat:
        from .harness.bloat import run_bloat_soak

        return run_bloat_soak(settings, args.soak, retention=args.retention, every=args.every,
                              pin_xmin=args.pin_xmin, pin_at=args.pin_at, max_runs=args.max_runs,
                              plot=args.plot)
    if args.command == "bench" and args.soak is not None:
        from .harness.soak import run_soak

        return run_soak(settings, args.soak, seed=args.seed, min_runs=args.min_runs)
    if args.command == "bench":
        from .harness.bench import run_bench

        return run_bench(settings, args.workload, repeat=args.repeat)
    if args.command == "ui":
        return _ui(settings, args.host, args.port, header_timeout=args.header_timeout,
                   max_connections=args.max_connections)
    # Named as the user set it: a database that cannot be connected to is one line
    # (DatabaseUnreachable, a RunpoolError main() prints), not a traceback.
    dsn = resolve_dsn(settings, announce=False)
    named = DSN_SETTING if settings.dsn else "the embedded PostgreSQL"
    # wait and runs --follow LISTEN: behind a pooler they take the direct DSN.
    listens = args.command == "wait" or (args.command == "runs" and args.follow)
    if listens and settings.listen_dsn:
        dsn, named = settings.listen_dsn, LISTEN_DSN_SETTING
    with reach(dsn, named,
               stateless=settings.stateless and dsn != settings.listen_dsn) as conn:
        if args.command == "migrate":
            return _migrate(conn, sql_only=args.sql)
        from .migrate import check, migrate

        if not settings.dsn:
            # The embedded database belongs to runpool: keep it at the current schema.
            migrate(conn)
        check(conn)  # a configured database: say what to run instead of failing obscurely
        try:
            if settings.read_dsn and _reads_only(args):
                with reach(settings.read_dsn, READ_DSN_SETTING,
                           stateless=settings.stateless) as replica:
                    check(replica)  # a replica still behind a migration says so
                    return run_command(replica, args, dsn, primary=conn)
            return run_command(conn, args, dsn)
        except psycopg.Error as exc:
            raise translate_error(exc) from exc


def _reads_only(args: argparse.Namespace) -> bool:
    """Whether the command only reads what a replica may serve a little late (never `wait`
    or `runs --follow`: NOTIFY does not reach a replica)."""
    return args.command in ("status", "schedules", "explain") or (
        args.command == "runs" and not args.follow)


def _run(settings: Settings) -> int:
    from .app import load_app
    from .supervisor import Supervisor

    app = load_app(settings.app)
    # OTEL_* settings no worker could build are refused here, once, not in every worker.
    otel_setup.check_env()
    if faults.armed():  # parsed here so a malformed spec is refused before any fork
        print(f"runpool: fault points armed: {', '.join(sorted(faults.armed()))}",
              file=sys.stderr)
    dsn = resolve_dsn(settings)
    if not settings.dsn:
        from .migrate import migrate

        with connect(dsn, autocommit=True) as conn:
            migrate(conn)
    return Supervisor(settings, dsn, app).run()


def _ui(settings: Settings, host: str, port: int, *, header_timeout: float | None,
        max_connections: int | None) -> int:
    try:
        import uvicorn

        from .web import create_app
        from .web.hosts import loopback_only
        from .web.serve import HEADER_TIMEOUT, MAX_CONNECTIONS, guarded_protocol, server_config
    except ImportError as exc:
        print(f"runpool: the web console needs its extra: pip install 'runpool[web]' ({exc})",
              file=sys.stderr)
        return EXIT_CONFIG
    try:
        # Checked before the database is touched: a bad bound is the operator's to fix.
        protocol = guarded_protocol(
            HEADER_TIMEOUT if header_timeout is None else header_timeout,
            MAX_CONNECTIONS if max_connections is None else max_connections)
    except ValueError as exc:
        print(f"runpool: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    dsn = resolve_dsn(settings)
    if not settings.dsn:
        from .migrate import migrate

        with connect(dsn, autocommit=True) as conn:
            migrate(conn)
    config = server_config(loopback_only(create_app(dsn, read_dsn=settings.read_dsn), host),
                           protocol, host=host, port=port, log_level="warning",
                           access_log=False)
    print(f"runpool: console on http://{host}:{port}/", file=sys.stderr, flush=True)
    uvicorn.Server(config).run()
    return 0


def _migrate(conn: psycopg.Connection[Any], *, sql_only: bool) -> int:
    from .migrate import migrate, script

    if sql_only:
        print(script(conn), end="")
        return 0
    applied = migrate(conn)
    for m in applied:
        print(f"applied {m.version:04d}_{m.name}")
    if not applied:
        print("schema is up to date")
    return 0
