"""runpool.testing: a public toolkit for testing code that runs on runpool (and runpool itself).

- `running_pool(dsn, "myapp.agents:app", concurrency=4)`: a real pool (supervisor and forked
  workers) for the length of a `with` block; `PoolProcess.workers()` gives pids to kill.
- `scratch_database(server_dsn)`: a migrated database of its own, dropped afterwards.
- `check(conn)` / `Watch(dsn)`: runpool's reliability invariants, checked after the fact and
  sampled while a pool runs (`record_execution` counts a tool's real executions).
- `Proxy(server_dsn)`: a TCP proxy that cuts, black-holes or refuses database connections.
- `wait_for(predicate, timeout)`: the bounded wait to use instead of sleeps.

The pool never imports this package (tests/test_package.py checks it); `runpool.testing.hostile`
holds the hostile-tenant inputs runpool's own tests and soak use.
"""

from __future__ import annotations

from .databases import database_name, scratch_database, with_database
from .invariants import EXECUTIONS_DDL, Report, Watch, check, record_execution
from .pools import PoolProcess, listener_pid, pool_env, running_pool, wait_for, worker_pids
from .proxy import Proxy

__all__ = [
    "EXECUTIONS_DDL",
    "PoolProcess",
    "Proxy",
    "Report",
    "Watch",
    "check",
    "database_name",
    "listener_pid",
    "pool_env",
    "record_execution",
    "running_pool",
    "scratch_database",
    "wait_for",
    "with_database",
    "worker_pids",
]
