"""The bounds of `python -m runpool ui`'s server (runpool.web.serve) with real sockets against a
real uvicorn: a client trickling its request head (slowloris) is dropped within the head
deadline while normal clients are served meanwhile; a connection beyond the cap is answered 503
at once; the deadline ends with the head, so a long event stream outlives it."""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx

from runpool.exits import EXIT_CONFIG
from runpool.web import create_app
from tests.helpers import ROOT, pool_env, scalar, wait_for
from tests.webserver import serving

HEADER_TIMEOUT = 1.0
# How late past the deadline a drop may be seen on a loaded 2-core machine.
SLACK = 2.0
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 10_000


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


def _response(sock: socket.socket) -> bytes:
    """One whole response of /healthz (it has a content-length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed after {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


class Slowloris(threading.Thread):
    """A client sending a request head one byte every `every` seconds and never finishing it
    (after one normal request when `keep_alive`); records how long the server let it live."""

    def __init__(self, address: tuple[str, int], *, keep_alive: bool = False,
                 every: float = 0.1) -> None:
        super().__init__(daemon=True)
        self.sock = socket.create_connection(address, timeout=10)
        self.keep_alive, self.every = keep_alive, every
        self.started_at = time.monotonic()
        self.lived: float | None = None
        self.sent = 0
        self.stop = threading.Event()

    def run(self) -> None:
        if self.keep_alive:
            self.sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert _response(self.sock).startswith(b"HTTP/1.1 200")
            self.started_at = time.monotonic()  # the deadline counts from the response
        for byte in HEAD:
            # The pause between bytes is the attack; the server closing ends it.
            readable, _, _ = select.select([self.sock], [], [], self.every)
            try:
                if readable and not self.sock.recv(65536):
                    break
                self.sock.send(bytes([byte]))
            except OSError:  # reset: closed too
                break
            self.sent += 1
            if self.stop.is_set():
                return
        self.lived = time.monotonic() - self.started_at

    def close(self) -> None:
        self.stop.set()
        self.join(timeout=10)
        self.sock.close()


def test_web_limits__slowloris_clients_are_dropped_within_the_bound_while_others_are_served(
        dsn: str) -> None:
    with serving(create_app(dsn), header_timeout=HEADER_TIMEOUT, max_connections=100) as url, \
            httpx.Client(base_url=url, timeout=10) as client:
        slow = [Slowloris(_address(url)) for _ in range(20)]
        slow += [Slowloris(_address(url), keep_alive=True) for _ in range(5)]
        try:
            for client_thread in slow:
                client_thread.start()
            served = 0
            # Normal clients, each on a fresh connection, while the slow ones trickle.
            while any(s.lived is None for s in slow) and served < 1000:
                answer = client.get("/healthz", headers={"connection": "close"})
                assert answer.status_code == 200, answer.text
                served += 1
            wait_for(lambda: all(s.lived is not None for s in slow),
                     timeout=HEADER_TIMEOUT + 10, what="every slow client to be dropped")
            lived = sorted(s.lived or 0.0 for s in slow)
            assert HEADER_TIMEOUT - 0.05 <= lived[0] and lived[-1] <= HEADER_TIMEOUT + SLACK, lived
            assert min(s.sent for s in slow) >= 3, "each slow client got bytes in first"
            assert served >= 3, served
        finally:
            for s in slow:
                s.close()


def test_web_limits__a_connection_beyond_the_cap_is_answered_503_until_the_idle_ones_go(
        dsn: str) -> None:
    with serving(create_app(dsn), header_timeout=HEADER_TIMEOUT, max_connections=5) as url:
        idle = [socket.create_connection(_address(url), timeout=10) for _ in range(5)]
        try:
            opened = time.monotonic()
            # Sent nothing: the server must still hold them (no head yet) ...
            with socket.create_connection(_address(url), timeout=10) as extra:
                refusal = extra.recv(4096)
            # ... and answer one more at once, before reading anything from it.
            assert refusal.startswith(b"HTTP/1.1 503"), refusal
            assert time.monotonic() - opened < HEADER_TIMEOUT, "refused before the deadline"
            for sock in idle:  # each dropped by the head deadline: EOF
                assert sock.recv(4096) == b""
            assert time.monotonic() - opened <= HEADER_TIMEOUT + SLACK
            answer = httpx.get(f"{url}/healthz", timeout=10)
            assert answer.status_code == 200, answer.text
        finally:
            for sock in idle:
                sock.close()


def test_web_limits__an_event_stream_outlives_the_head_deadline(dsn: str, conn) -> None:
    run_id: uuid.UUID = scalar(conn, "SELECT runpool.enqueue('acme', 'chat', '{}')")
    with serving(create_app(dsn), header_timeout=HEADER_TIMEOUT) as url, \
            socket.create_connection(_address(url), timeout=10) as sock:
        sock.sendall(f"GET /api/runs/{run_id}/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
                     .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(65536)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head, head
        # The run is queued (no pool): its stream stays open well past the deadline.
        until = time.monotonic() + HEADER_TIMEOUT * 3
        while (left := until - time.monotonic()) > 0:
            readable, _, _ = select.select([sock], [], [], left)
            assert not readable or sock.recv(65536) != b"", "the stream was closed"


def test_cli_ui__takes_both_bounds_from_flags_and_refuses_bad_ones(dsn: str) -> None:
    with socket.socket() as probe:  # a free port (the server binds it a moment later)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bad = subprocess.run([sys.executable, "-m", "runpool", "ui", "--max-connections", "0"],
                         env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == EXIT_CONFIG and "max_connections" in bad.stderr, bad.stderr
    proc = subprocess.Popen([sys.executable, "-m", "runpool", "ui", "--port", str(port),
                             "--header-timeout", "1", "--max-connections", "3"],
                            env=pool_env(dsn), cwd=ROOT, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).text == "ok"
            except httpx.TransportError:
                return False

        wait_for(up, timeout=30, what="python -m runpool ui to serve")
        silent = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(3)]
        try:
            opened = time.monotonic()
            with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
                assert extra.recv(4096).startswith(b"HTTP/1.1 503")
            for sock in silent:
                assert sock.recv(4096) == b""
            assert time.monotonic() - opened <= 1.0 + SLACK
        finally:
            for sock in silent:
                sock.close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=15)
