"""runpool.testing.pgbouncer, skipped (or failed, under RUNPOOL_TEST_REQUIRE_SYSTEM=1) when
Debian's pgbouncer is not installed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from runpool.testing.pgbouncer import PGBOUNCER, Bouncer, free_port
from runpool.testing.pgbouncer import pgbouncer as _pgbouncer
from tests.system import require_program

__all__ = ["Bouncer", "free_port", "pgbouncer"]


@contextmanager
def pgbouncer(server_dsn: str, *, pool_size: int) -> Iterator[Bouncer]:
    require_program(PGBOUNCER, "pgbouncer")
    with _pgbouncer(server_dsn, pool_size=pool_size) as bouncer:
        yield bouncer
