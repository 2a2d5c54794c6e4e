"""A real PgBouncer in transaction mode in front of a PostgreSQL server, started on a free
port (Debian's package `pgbouncer`), for tests and benchmarks of pooler mode.

PgBouncer refuses to run as root: as root it switches (`-u`) to user postgres, or to the owner
of the server's socket directory when the server is reached over a Unix socket."""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

__all__ = ["PGBOUNCER", "Bouncer", "free_port", "pgbouncer"]

PGBOUNCER = "/usr/sbin/pgbouncer"

CONFIG = """\
[databases]
* = host={host} port={port}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {dir}/users.txt
admin_users = {user}
pool_mode = transaction
default_pool_size = {pool_size}
min_pool_size = 0
reserve_pool_size = 0
max_client_conn = 500
max_db_connections = {pool_size}
server_lifetime = 3600
server_idle_timeout = 600
logfile = {dir}/pgbouncer.log
pidfile = {dir}/pgbouncer.pid
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Bouncer:
    """A running PgBouncer: `dsn(target)` is `target` (a test database's DSN) through it."""

    port: int
    pool_size: int
    user: str
    directory: Path

    def dsn(self, target: str, **extra: Any) -> str:
        params = conninfo_to_dict(target)
        params.update(host="127.0.0.1", port=str(self.port), **extra)
        return make_conninfo(**params)  # type: ignore[arg-type]

    def admin(self, command: str) -> list[dict[str, Any]]:
        """A SHOW command of the admin console, as rows."""
        dsn = make_conninfo(host="127.0.0.1", port=str(self.port), dbname="pgbouncer",
                            user=self.user)
        with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
            cur = conn.cursor(row_factory=psycopg.rows.dict_row)
            cur.execute(command)
            return cur.fetchall()

    def log(self) -> str:
        path = self.directory / "pgbouncer.log"
        return path.read_text(errors="replace") if path.exists() else ""


@contextmanager
def pgbouncer(server_dsn: str, *, pool_size: int) -> Iterator[Bouncer]:
    """PgBouncer in transaction mode forwarding every database of `server_dsn`'s server, with
    at most `pool_size` server connections per database."""
    if not Path(PGBOUNCER).is_file():
        raise FileNotFoundError(f"{PGBOUNCER} is missing: apt-get install pgbouncer")
    params = conninfo_to_dict(server_dsn)
    user = str(params.get("user") or "postgres")
    directory = Path(tempfile.mkdtemp(prefix="runpool-pgbouncer-"))
    port = free_port()
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    (directory / "pgbouncer.ini").write_text(CONFIG.format(
        host=params.get("host", "127.0.0.1"), port=params.get("port", 5432),
        listen_port=port, dir=directory, user=user, pool_size=pool_size))
    command = [PGBOUNCER, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:
        # As the user that can reach the server: a server on a Unix socket (the embedded one)
        # keeps its socket in a directory only its own user may enter.
        host = str(params.get("host") or "")
        owner = (pwd.getpwuid(Path(host).stat().st_uid).pw_name
                 if host.startswith("/") else "postgres")
        shutil.chown(directory, owner)
        for path in directory.iterdir():
            shutil.chown(path, owner)
        # Its own switch, not runuser: the process the signal below reaches is PgBouncer.
        command = [PGBOUNCER, "-u", owner, str(directory / "pgbouncer.ini")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    bouncer = Bouncer(port, pool_size, user, directory)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                bouncer.admin("SHOW VERSION")
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("pgbouncer did not start:\n" + bouncer.log()) from None
                time.sleep(0.05)
        yield bouncer
    finally:
        proc.send_signal(signal.SIGTERM)  # PgBouncer's immediate shutdown
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(directory, ignore_errors=True)
