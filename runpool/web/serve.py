"""How `python -m runpool ui` serves the app: uvicorn, with two bounds uvicorn lacks.

uvicorn has no timeout for reading a request's head. `timeout_keep_alive` is armed only once
a response is complete and is reset by every byte that arrives, so a client that opens a
connection and sends its headers a byte at a time (slowloris) holds a socket, and its memory,
for as long as it likes; `limit_concurrency` counts those connections but only answers 503 to
requests whose heads have arrived, so it turns a slowloris flood into refusals of everyone
else. Here each connection gets a deadline for its request head (from the connection, or from
the end of the previous response on a kept-alive one, until the head is parsed), and the
server holds at most `max_connections` sockets: one beyond is answered 503 and closed at once,
before any of it is read. A head over h11's 16 KiB is uvicorn's own 400.

The deadline ends when the head is parsed, so a long response (an event stream) is unbounded,
as it must be. The protocol is uvicorn's h11 one, named rather than "auto": the hooks below
are tested against it, whether or not httptools happens to be installed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Final

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

__all__ = ["HEADER_TIMEOUT", "MAX_CONNECTIONS", "guarded_protocol", "server_config"]

logger = logging.getLogger("runpool.web")

# Seconds a client has to send a request's head (Go's ReadHeaderTimeout is commonly 10 s;
# nginx's client_header_timeout is 60 s): any real client sends it in one packet.
HEADER_TIMEOUT: Final = 10.0
# Sockets the server holds at once: the app's 400 event streams, its pool's 8 database
# connections and its streams' hub's 5 stay well inside the usual 1,024 file descriptors.
MAX_CONNECTIONS: Final = 500
# What a connection beyond the cap is answered, before its request is read.
REFUSAL: Final = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8"
                  b"\r\ncontent-length: 20\r\nconnection: close\r\n\r\ntoo many connections")
# Refusals are counted and logged at most this often: a flood must not flood the log.
LOG_EVERY: Final = 10.0


class _Tally:
    """Refusals and drops since the last log line, logged at most every LOG_EVERY seconds."""

    def __init__(self) -> None:
        self.counts = {"web_header_timeout": 0, "web_connection_refused": 0}
        self._logged = 0.0

    def add(self, action: str, cap: int, timeout: float) -> None:
        self.counts[action] += 1
        now = time.monotonic()
        if now - self._logged < LOG_EVERY:
            return
        self._logged = now
        for name, count in self.counts.items():
            if count:
                logger.warning("%s connection(s) %s", count,
                               "beyond the cap refused" if name == "web_connection_refused"
                               else "dropped for not sending a request head in time",
                               extra={"action": name, "count": count, "max_connections": cap,
                                      "header_timeout": timeout})
                self.counts[name] = 0


def guarded_protocol(header_timeout: float, max_connections: int) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a request-head deadline and a connection cap."""
    if not header_timeout > 0:
        raise ValueError(f"header_timeout must be > 0 seconds, got {header_timeout!r}")
    if isinstance(max_connections, bool) or not max_connections >= 1:
        raise ValueError(f"max_connections must be >= 1, got {max_connections!r}")
    tally = _Tally()

    class Guarded(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        # The request cycle the deadline was armed after: a new one means a head was parsed.
        _armed_after: object = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                tally.add("web_connection_refused", max_connections, header_timeout)
                transport.write(REFUSAL)
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._timer is not None and self.cycle is not self._armed_after:
                self._disarm()

        def on_response_complete(self) -> None:
            done = self.cycle
            super().on_response_complete()
            # A pipelined request already parsed has a new cycle: its head is in.
            if self.cycle is done and not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._armed_after = self.cycle
            self._timer = self.loop.call_later(header_timeout, self._expire)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expire(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                tally.add("web_header_timeout", max_connections, header_timeout)
                self.transport.close()

    return Guarded


def server_config(app: Any, protocol: type[H11Protocol], **options: Any) -> uvicorn.Config:
    """The uvicorn configuration serving `app` over `protocol` (guarded_protocol's); `options`
    are uvicorn's (host, port, log_level, ...). No WebSocket: the app has no such route, and
    an upgraded connection would leave the head deadline's protocol behind."""
    return uvicorn.Config(app, http=protocol, ws="none", **options)
