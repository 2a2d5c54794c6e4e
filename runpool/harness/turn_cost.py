"""W11cpu: what one agent turn's checkpoint writes cost, in CPU, on each side. W11's turn (a tool
call's intent, its result with its tool message, a message) for `runs` runs at once, through a
worker's own Run and group commit, in this process, with no model wait: the writes always
queue, as W11's do at load. CPU time of this process (the worker's side) and of the pool's
server backends (the database's side), per turn: load moves these far less than wall time.
W11cpup: the same with the pool's sessions as behind a transaction-mode pooler (straight to
the server): stateless, the batches calling the batch statements' functions (runpool.pooled).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any, Final

from psycopg_pool import AsyncConnectionPool

from ..commits import CommitGroup
from ..context import Run
from ..db import connect
from ..enqueue import RunSpec, enqueue_many
from ..pools import open_pool
from ..testing.databases import scratch_database
from ..trips import Via
from .measure import cpu_seconds

__all__ = ["w11_turn_cost"]

# The runs as a worker holds them (no pool: nothing here finishes them).
HOLD: Final = """
UPDATE runpool.runs SET status = 'running', attempt = 1, started_at = now(),
       lease_expires_at = now() + interval '1 hour'
RETURNING id
"""
# The server processes of this database's sessions (the pool's backends).
BACKENDS: Final = "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"


async def _lookup(arguments: Any, key: str) -> Any:
    return {"turn": arguments["turn"], "hits": ["a result line of a search tool"] * 3}


async def _turns(dsn: str, ids: list[uuid.UUID], turns: int, pool_size: int, via: Via
                 ) -> dict[str, Any]:
    pool: AsyncConnectionPool = await open_pool(dsn, size=pool_size, name="w11cpu",
                                                stateless=via != "prepared")
    try:
        async with pool.connection() as conn:  # opened whole (open_pool waits for all)
            backends = [pid for (pid,) in await (await conn.execute(BACKENDS)).fetchall()]
        group = CommitGroup(pool, via=via)
        runs = [Run(id=i, tenant="bench", handler="agent", attempt=1, input={}, pool=pool,
                    commits=group) for i in ids]

        async def agent(run: Run) -> None:
            rng = random.Random(str(run.id))
            for turn in range(turns):
                await asyncio.sleep(rng.uniform(0, 0.05))
                found = await run.tool(f"t{turn}", "search", {"turn": turn}, _lookup)
                await run.add_message("assistant", {"turn": turn, "read": len(found["hits"])})

        server, mine, began = cpu_seconds(backends), time.process_time(), time.monotonic()
        await asyncio.gather(*(agent(r) for r in runs))
        done = len(runs) * turns
        return {"turns": done, "seconds": round(time.monotonic() - began, 1),
                "worker_cpu_us_per_turn": round((time.process_time() - mine) / done * 1e6, 1),
                "server_cpu_us_per_turn": round(
                    (cpu_seconds(backends) - server) / done * 1e6, 1),
                "commits_per_turn": round(group.commits / done, 3),
                "statements_per_turn": round(group.statements / done, 3),
                "pipelined_share": round(group.pipelined / max(group.writes, 1), 3)}
    finally:
        await pool.close()


def w11_turn_cost(server: str, *, runs: int = 500, turns: int = 10, pool_size: int = 16,
                  via: Via = "prepared") -> dict[str, Any]:
    """W11cpu: `runs` runs x `turns` turns of W11's writes; CPU per turn, each side. `via`
    (runpool.trips.Via): "functions" or "pipeline", the pool's sessions stateless."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        enqueue_many(conn, [RunSpec("bench", "agent", {})] * runs)
        ids = [i for (i,) in conn.execute(HOLD)]
        name = {"prepared": "W11cpu", "functions": "W11cpup", "pipeline": "W11cpus"}[via]
        return {"workload": name, "runs": runs, "pool_size": pool_size,
                **asyncio.run(_turns(dsn, ids, turns, pool_size, via))}
