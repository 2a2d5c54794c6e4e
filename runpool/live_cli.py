"""The command line of live runs: `wait RUN_ID` and `runs RUN_ID --follow`."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from contextlib import aclosing
from typing import Any, Final

import psycopg

from .db import aconnect
from .live import RunEvent, follow, wait

__all__ = ["EXIT_TIMEOUT", "follow_command", "render_event", "wait_command"]

# `wait`: 0 succeeded, 1 failed or cancelled (or no such run), 3 timed out.
EXIT_TIMEOUT: Final = 3


def wait_command(conn: psycopg.Connection[Any], run_id: uuid.UUID, timeout: float | None,
                 *, as_json: bool) -> int:
    try:
        res = wait(conn, run_id, timeout)
    except TimeoutError as exc:
        print(f"runpool: {exc}", file=sys.stderr)
        return EXIT_TIMEOUT
    if as_json:
        print(json.dumps({"id": str(res.id), "status": res.status, "result": res.result,
                          "error": res.error}))
    else:
        print(res.status)
        detail = res.result if res.status == "succeeded" else res.error
        if detail is not None:
            print(json.dumps(detail))
    return 0 if res.status == "succeeded" else 1


def render_event(event: RunEvent) -> str:
    """One line per event: seq, time, kind, and what happened."""
    d: Any = event.data
    if event.kind == "status":
        what = f"{d['status']} (attempt {d['attempt']}" + (
            f", {d['reason']})" if d.get("reason") else ")")
    elif event.kind == "message":
        what = f"{d['role']}: {json.dumps(d['content'])}"
    elif event.kind == "tool_call":
        what = f"{d['name']} {d['call_id']} {d['status']}" + (
            f" -> {json.dumps(d['result'])}" if "result" in d and d["result"] is not None else "")
    else:
        what = json.dumps(d)
    return f"{event.seq:>5} {event.at:%H:%M:%S.%f} {event.kind:<9} {what}"[:2000]


def follow_command(dsn: str, run_id: uuid.UUID, *, after: int, as_json: bool) -> int:
    async def main() -> int:
        aconn = await aconnect(dsn, autocommit=True)
        async with aconn:
            async with aclosing(follow(aconn, run_id, after)) as events:
                async for event in events:
                    line = (json.dumps({"seq": event.seq, "kind": event.kind, "data": event.data,
                                        "at": event.at.isoformat()})
                            if as_json else render_event(event))
                    print(line, flush=True)
        return 0

    return asyncio.run(main())
