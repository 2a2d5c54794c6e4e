"""Private PostgreSQL clusters for the multi-host tests: started on free ports in temporary
directories (never the shared test server, which other tests use), a synchronous streaming
standby made with pg_basebackup, and hosts as network namespaces joined to the cluster by
veth pairs. As root, the clusters run as user postgres (initdb refuses root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from runpool.db import connect
from runpool.migrate import migrate
from runpool.testing import EXECUTIONS_DDL, wait_for, with_database
from tests.pgbouncer import free_port
from tests.system import require_program, require_root

BIN = Path("/usr/lib/postgresql/15/bin")
STANDBY_NAME = "standby1"


def _as_postgres(command: Sequence[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *command] if os.geteuid() == 0 else [*command]


def _run(command: Sequence[str], timeout: float = 60) -> None:
    out = subprocess.run(_as_postgres(command), capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise AssertionError(f"{' '.join(command)} failed: {out.stdout}\n{out.stderr}")


def _private_dir(prefix: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if os.geteuid() == 0:
        shutil.chown(path, "postgres")
    return path


@dataclass
class Cluster:
    """One PostgreSQL cluster of ours: `data` its directory, listening on `addresses`:`port`."""

    data: Path
    port: int
    addresses: tuple[str, ...] = ("127.0.0.1",)
    settings: dict[str, str] = field(default_factory=dict)

    def dsn(self, dbname: str = "postgres", host: str = "127.0.0.1") -> str:
        return make_conninfo(host=host, port=str(self.port), user="postgres", dbname=dbname)

    def start(self) -> None:
        options = " ".join([f"-c listen_addresses='{','.join(self.addresses)}'",
                            f"-c port={self.port}", "-c unix_socket_directories=''",
                            *(f"-c {k}={v}" for k, v in self.settings.items())])
        _run([str(BIN / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(self.data),
              "-l", str(self.data / "server.log"), "-o", options], timeout=90)

    def stop(self, mode: str = "fast") -> None:
        """`mode` immediate: as a crash (no checkpoint, connections cut at once)."""
        if (self.data / "postmaster.pid").exists():
            _run([str(BIN / "pg_ctl"), "stop", "-w", "-D", str(self.data), "-m", mode])

    def promote(self) -> None:
        _run([str(BIN / "pg_ctl"), "promote", "-w", "-D", str(self.data)])

    def log(self) -> str:
        path = self.data / "server.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


def _require_binaries() -> None:
    for program in ("initdb", "pg_ctl", "pg_basebackup"):
        require_program(str(BIN / program), "postgresql-15")
    if os.geteuid() == 0:
        require_program("/usr/sbin/runuser", "util-linux")


@contextmanager
def cluster(*, addresses: tuple[str, ...] = ("127.0.0.1",),
            settings: dict[str, str] | None = None) -> Iterator[Cluster]:
    """A new cluster (trust authentication: it listens on test addresses only)."""
    _require_binaries()
    data = _private_dir("runpool-cluster-")
    try:
        _run([str(BIN / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
              "--no-sync", "-E", "UTF8"], timeout=120)
        with open(data / "pg_hba.conf", "a") as hba:
            # The namespaced hosts' addresses (10.77.0.0/16, see netns_hosts) and replication.
            hba.write("host all all 10.77.0.0/16 trust\n")
        node = Cluster(data, free_port(), addresses, dict(settings or {}))
        node.start()
        try:
            yield node
        finally:
            node.stop("immediate")
    finally:
        shutil.rmtree(data, ignore_errors=True)


@contextmanager
def synchronous_pair() -> Iterator[tuple[Cluster, Cluster]]:
    """A primary and its synchronous streaming standby: a commit is acknowledged only once
    the standby has it on disk."""
    with cluster(settings={"synchronous_standby_names": f"'{STANDBY_NAME}'",
                           "wal_level": "replica", "max_wal_senders": "5"}) as primary:
        data = _private_dir("runpool-standby-")
        try:
            os.rmdir(data)  # pg_basebackup wants to create it (as postgres, so its parent is)
            _run([str(BIN / "pg_basebackup"), "-h", "127.0.0.1", "-p", str(primary.port),
                  "-U", "postgres", "-D", str(data), "-X", "stream", "-R"], timeout=120)
            conninfo = (f"host=127.0.0.1 port={primary.port} user=postgres"
                        f" application_name={STANDBY_NAME}")
            with open(data / "postgresql.auto.conf", "a") as conf:
                conf.write(f"primary_conninfo = '{conninfo}'\n")
            standby = Cluster(data, free_port())
            standby.start()
            try:
                with psycopg.connect(primary.dsn(), autocommit=True) as conn:
                    wait_for(lambda: conn.execute(
                        "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
                    ).fetchone() == (1,), 30, 0.1, "the standby to become sync")
                yield primary, standby
            finally:
                standby.stop("immediate")
        finally:
            shutil.rmtree(data, ignore_errors=True)


def migrated_database(server_dsn: str) -> str:
    """A migrated database with the test apps' side tables, on one of our clusters (thrown
    away with its cluster: nothing to drop)."""
    name = f"runpool_hosts_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = with_database(server_dsn, name)
    with connect(dsn, autocommit=True) as conn:
        migrate(conn)
        conn.execute(EXECUTIONS_DDL)
        conn.execute("CREATE TABLE model_calls (run_id uuid, turn int, attempt int)")
    return dsn


@dataclass(frozen=True)
class Host:
    """A network namespace joined to the root namespace by a veth pair: `address` is its
    side, `server_address` the root side (where a cluster can listen for it)."""

    namespace: str
    link: str  # the root namespace's end of the pair: down cuts the host off, silently
    address: str
    server_address: str

    def command(self, command: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.namespace, *command]

    def cut(self) -> None:
        subprocess.run(["ip", "link", "set", self.link, "down"], check=True)

    def heal(self) -> None:
        subprocess.run(["ip", "link", "set", self.link, "up"], check=True)


@contextmanager
def netns_hosts(count: int) -> Iterator[list[Host]]:
    """`count` hosts, each a network namespace with a veth pair to the root namespace on a
    /24 of its own (10.77.N.2 the host, 10.77.N.1 the root side)."""
    require_root("a host as a network namespace")
    require_program("/usr/sbin/ip", "iproute2")
    tag = uuid.uuid4().hex[:5]
    hosts: list[Host] = []
    try:
        for i in range(count):
            subnet = 100 + i
            host = Host(f"rp{tag}{i}", f"rp{tag}{i}a", f"10.77.{subnet}.2", f"10.77.{subnet}.1")
            peer = f"rp{tag}{i}b"
            hosts.append(host)
            for cmd in (["ip", "netns", "add", host.namespace],
                        ["ip", "link", "add", host.link, "type", "veth", "peer", "name", peer],
                        ["ip", "link", "set", peer, "netns", host.namespace],
                        ["ip", "addr", "add", f"{host.server_address}/24", "dev", host.link],
                        ["ip", "link", "set", host.link, "up"],
                        host.command(["ip", "addr", "add", f"{host.address}/24", "dev", peer]),
                        host.command(["ip", "link", "set", peer, "up"]),
                        host.command(["ip", "link", "set", "lo", "up"])):
                subprocess.run(cmd, check=True, capture_output=True)
        yield hosts
    finally:
        for host in hosts:
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
