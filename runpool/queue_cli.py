"""The command line's database commands on runs and the queue (enqueue, cancel, retry,
resolve, signal, explain, runs, wait, status, schedules): `runpool.cli` parses the flags and
connects; each command answers with its exit code (0 ok, 1 no such run)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import psycopg

from .errors import InvalidInput
from .limits import check_tenant, check_text

__all__ = ["run_command"]

# The SQL API, called exactly as an application would.
CANCEL = "SELECT runpool.cancel_run(%s::uuid, %s, %s)"
RETRY = "SELECT runpool.retry_run(%s::uuid)"
EXPLAIN = "SELECT runpool.explain_run(%s::uuid)"


def _json(text: str, flag: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidInput(f"{flag} is not valid JSON: {exc}") from None


def _parse_run_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise InvalidInput(f"not a run id (a UUID): {text!r}") from None


def run_command(conn: psycopg.Connection[Any], args: argparse.Namespace, dsn: str, *,
                primary: psycopg.Connection[Any] | None = None) -> int:
    """Run the database command `args.command` on `conn`; its exit code. `conn` is a read
    replica's connection for the read-only commands when RUNPOOL_READ_DSN is set, and
    `primary` then the primary's."""
    if args.command == "enqueue":
        from .enqueue import enqueue

        payload = _json(args.input, "--input")
        budget = None if args.budget is None else _json(args.budget, "--budget")
        run_id = enqueue(conn, args.tenant, args.handler, payload, priority=args.priority,
                         idempotency_key=args.idempotency_key, run_at=args.run_at,
                         max_attempts=args.max_attempts, serial_key=args.serial_key,
                         timeout=args.timeout, deadline=args.deadline, budget=budget)
        print(run_id)
        return 0
    if args.command == "cancel":
        if args.reason is not None:
            check_text("--reason", args.reason)
        row = conn.execute(CANCEL, (_parse_run_id(args.run_id), args.reason,
                                    check_tenant(args.tenant))).fetchone()
        return _answer(row, args.run_id)
    if args.command == "retry":
        row = conn.execute(RETRY, (_parse_run_id(args.run_id),)).fetchone()
        return _answer(row, args.run_id)
    if args.command == "resolve":
        from .resolve import resolve_tool_call

        result = _json(args.result, "--result") if args.result is not None else None
        kind: dict[str, Any] = {"retry": True} if args.retry else {"result": result}
        answer = resolve_tool_call(conn, _parse_run_id(args.run_id), args.call_id,
                                   tenant=args.tenant, **kind)
        if answer is None:
            print(f"no such run or tool call: {args.run_id} {args.call_id}", file=sys.stderr)
            return 1
        print(answer)
        return 0
    if args.command == "signal":
        from .waits import signal_run

        payload = _json(args.payload, "--payload")
        answer = signal_run(conn, _parse_run_id(args.run_id), args.name, payload,
                            tenant=args.tenant)
        return _answer((answer,), args.run_id)
    if args.command == "explain":
        row = conn.execute(EXPLAIN, (_parse_run_id(args.run_id),)).fetchone()
        if row is None or row[0] is None:
            return _answer(None, args.run_id)
        doc = row[0]
        if args.json:
            print(json.dumps(doc))
        else:
            print(doc.pop("summary"))
            for key, value in doc.items():
                print(f"  {key}: {value}")
        return 0
    if args.command == "wait":
        from .live_cli import wait_command

        return wait_command(conn, _parse_run_id(args.run_id), args.timeout, as_json=args.json)
    if args.command == "runs" and args.follow:
        from .live_cli import follow_command

        return follow_command(dsn, _parse_run_id(args.run_id), after=args.after,
                              as_json=args.json)
    if args.command == "runs":
        from .status import history, render_history

        doc = history(conn, _parse_run_id(args.run_id))
        if doc is None:
            return _answer(None, args.run_id)
        print(json.dumps(doc) if args.json else render_history(doc))
        return 0
    if args.command == "status":
        return _status(conn, args, primary or conn)
    if args.command == "schedules":
        from .status import render_schedules, schedules

        listing = schedules(conn)
        print(json.dumps(listing) if args.json else render_schedules(listing))
        return 0
    raise AssertionError(args.command)


def _status(conn: psycopg.Connection[Any], args: argparse.Namespace,
            primary: psycopg.Connection[Any]) -> int:
    from .status import collect, render

    if args.watch is None:
        report = collect(conn, window_seconds=args.window, xmin_warn_seconds=args.xmin_warn,
                         primary=primary)
        print(json.dumps(report) if args.json else render(report))
        return 0
    try:
        while True:
            screen = render(collect(conn, window_seconds=args.window,
                                    xmin_warn_seconds=args.xmin_warn, primary=primary))
            # Home the cursor and clear: the view refreshes in place.
            print("\x1b[H\x1b[2J" + screen, flush=True)
            time.sleep(max(args.watch, 0.2))
    except KeyboardInterrupt:
        return 0


def _answer(row: tuple[Any, ...] | None, run_id: str) -> int:
    if row is None or row[0] is None:
        print(f"no such run: {run_id}", file=sys.stderr)
        return 1
    print(row[0])
    return 0
