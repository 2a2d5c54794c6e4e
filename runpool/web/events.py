"""`GET /api/runs/{id}/events`: runpool.follow over Server-Sent Events.

One SSE event per RunEvent: `id:` its seq, `event:` its kind, `data:` the whole event as JSON
({"seq", "kind", "data", "at"}). A reconnecting browser sends `Last-Event-ID` and gets exactly
the rest (follow's `after`); `?after=` does the same for clients that cannot set the header.
The stream ends after the run's terminal status; a reconnect after that is answered 204, which
tells an EventSource to stop reconnecting.

The app's streams share one runpool.live_hub.FollowHub: one LISTEN connection and a few
readers, whatever the number of streams (a connection per stream took a quarter of the
server's connections for 25 streams, and woke the server's backends once per stream at every
doorbell). Streams are capped per app and, with a tenant_of, per tenant, so no tenant can take
every stream. A slow client only slows its own stream: events wait in a small buffer, then its
follower waits for the client (it holds no connection meanwhile), and the run never waits for
a follower.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any, Final

import orjson
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from runpool.errors import InvalidInput
from runpool.live import TERMINAL, RunEvent
from runpool.live_hub import FollowHub
from runpool.tasks import cancel_all

from .state import parse_run_id, web_of

__all__ = ["APPLICATION_NAME", "MAX_STREAMS", "MAX_STREAMS_PER_TENANT", "frame", "run_events"]

logger = logging.getLogger("runpool.web")

# Open streams per app (each a client's socket, within `runpool ui`'s 500: serve.py), and per
# tenant with a tenant_of.
MAX_STREAMS: Final = 400
MAX_STREAMS_PER_TENANT: Final = 50
# A comment line this often keeps proxies from closing a quiet stream (a queued run).
KEEPALIVE_SECONDS: Final = 15.0
# Events read ahead of a slow client.
BUFFER: Final = 64
# Seconds follow waits for a notification before it reads anyway (its fallback poll).
POLL_SECONDS: Final = 1.0
# The largest seq accepted (follow's own bound).
MAX_SEQ: Final = 2**62
# What the streams' hub's connections are called in pg_stat_activity (its LISTEN connection's
# name ends in "-listen").
APPLICATION_NAME: Final = "runpool-web-follow"


def _after(request: Request) -> int:
    """Where the stream starts: Last-Event-ID (a reconnect) or ?after=, else 0 (everything)."""
    for name, text in (("Last-Event-ID", request.headers.get("last-event-id")),
                       ("after", request.query_params.get("after"))):
        if text is None or text == "":
            continue
        # ASCII digits only: str.isdigit also takes '²' (which int() refuses) and '١'.
        if not (text.isascii() and text.isdigit()) or int(text) > MAX_SEQ:
            raise InvalidInput(f"{name}: must be an event seq (an integer from 0 to {MAX_SEQ}),"
                               f" not {text[:40]!r}")
        return int(text)
    return 0


def frame(event: RunEvent) -> bytes:
    """One SSE event (orjson writes no newline, so the data is one line)."""
    data = orjson.dumps({"seq": event.seq, "kind": event.kind, "data": event.data,
                         "at": event.at.isoformat()})
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (event.seq, event.kind.encode(), data)


async def _stream(hub: FollowHub, run_id: uuid.UUID, after: int, tenant: str | None
                  ) -> AsyncIterator[bytes]:
    queue: asyncio.Queue[RunEvent | BaseException | None] = asyncio.Queue(BUFFER)

    async def pump() -> None:
        try:
            async with contextlib.aclosing(hub.follow(run_id, after, poll=POLL_SECONDS,
                                                      tenant=tenant)) as events:
                async for event in events:
                    await queue.put(event)
            await queue.put(None)
        except Exception as exc:  # the database went away: end the stream, the client resumes
            await queue.put(exc)

    task = asyncio.create_task(pump(), name=f"runpool-web-follow-{run_id}")
    try:
        yield b"retry: 2000\n\n"
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), KEEPALIVE_SECONDS)
            except TimeoutError:
                yield b": keepalive\n\n"
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                logger.warning("following run %s failed: %r", run_id, item,
                               extra={"action": "follow_failed", "run_id": str(run_id)})
                return
            yield frame(item)
    finally:
        await cancel_all([task])  # (a cancel a wait swallowed would leave the pump running)


class _EventStream(StreamingResponse):
    """A stream that gives its slot back however it ends (done, failed, or the client went
    away before it even started)."""

    def __init__(self, body: AsyncIterator[bytes], release: Any) -> None:
        super().__init__(body, media_type="text/event-stream", headers={
            "cache-control": "no-cache", "x-accel-buffering": "no"})
        self.release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()


async def run_events(request: Request) -> Response:
    web = web_of(request)
    tenant = await web.scope(request)
    run_id = parse_run_id(request.path_params["id"])
    after = _after(request)
    async with web.connection() as conn:
        rows = await web.rows(conn, "run", {"id": run_id, "tenant": tenant})
    if not rows:
        raise HTTPException(404, "no such run")
    run = rows[0]["run"]
    if run["status"] in TERMINAL and after >= run.get("event_seq", 0):
        return Response(status_code=204)  # nothing more will come: stop reconnecting
    if sum(web.streams.values()) >= MAX_STREAMS:
        raise HTTPException(503, "too many event streams open; try again later")
    if tenant is not None and web.streams.get(tenant, 0) >= MAX_STREAMS_PER_TENANT:
        raise HTTPException(429, f"at most {MAX_STREAMS_PER_TENANT} event streams per tenant")
    web.streams[tenant] = web.streams.get(tenant, 0) + 1

    def release() -> None:
        # No entry left at 0: one per tenant ever seen would grow without bound.
        left = web.streams[tenant] - 1
        if left:
            web.streams[tenant] = left
        else:
            del web.streams[tenant]

    assert web.hub is not None  # (opened with the pool, which web.connection opened)
    return _EventStream(_stream(web.hub, run_id, after, tenant), release)
