"""A TCP proxy between workers and PostgreSQL that can cut, black-hole or refuse connections:
the network faults of the reliability tests and the soak (`bench --soak`).

Black-holed, it keeps every socket open but forwards nothing (what a dead NAT entry or a
partition looks like from the client: no error, no answer). Healed, new connections work again;
connections that lost bytes while black-holed stay broken and must be dropped by the client.
Down, it resets every connection and refuses new ones (an outage: the database is gone).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["Proxy"]


class Proxy:
    def __init__(self, server_dsn: str) -> None:
        params = conninfo_to_dict(server_dsn)
        host = str(params.get("host") or "/tmp")
        port = int(params.get("port") or 5432)
        # The embedded server listens on a Unix socket only; a configured one may use TCP.
        self._upstream: Any = (f"{host}/.s.PGSQL.{port}" if host.startswith("/")
                               else (host, port))
        self.blackholed = threading.Event()
        self.refusing = threading.Event()
        self.connections = 0
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def dsn(self, dsn: str) -> str:
        """`dsn` (a database on the proxied server), reached through the proxy."""
        params = conninfo_to_dict(dsn)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo(**params)  # type: ignore[arg-type]

    def close(self) -> None:
        self._listener.close()
        self.cut()

    def down(self) -> None:
        """Refuse new connections and reset the existing ones, until up()."""
        self.refusing.set()
        self.cut()

    def up(self) -> None:
        self.refusing.clear()

    def cut(self) -> None:
        """Reset every connection made so far (both sides see it die at once)."""
        sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
                s.close()
            except OSError:
                pass

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refusing.is_set():
                client.close()
                continue
            family = socket.AF_UNIX if isinstance(self._upstream, str) else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            upstream.connect(self._upstream)
            self.connections += 1
            self._sockets += [client, upstream]
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                if not self.blackholed.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
