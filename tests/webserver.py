"""A real uvicorn server for runpool.web apps, on a free loopback port, in a thread."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from runpool.web.serve import HEADER_TIMEOUT, MAX_CONNECTIONS, guarded_protocol, server_config
from tests.helpers import wait_for

__all__ = ["serving"]


@contextmanager
def serving(app: Any, *, header_timeout: float = HEADER_TIMEOUT,
            max_connections: int = MAX_CONNECTIONS) -> Iterator[str]:
    """Serve app with uvicorn as `python -m runpool ui` does (runpool.web.serve) until the block
    exits; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(server_config(app, guarded_protocol(header_timeout, max_connections),
                                          log_level="warning", lifespan="on",
                                          timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started or not thread.is_alive(), timeout=30,
                 what="uvicorn to start")
        assert server.started, "uvicorn did not start (see the log above)"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
        assert not thread.is_alive(), "uvicorn did not stop"
