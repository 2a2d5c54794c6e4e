"""Client CPU of a worker's outcome batch with its refill claim, per batch.

    PYTHONPATH=<runpool tree> python docs/batch_cpu.py SERVER_DSN
    (env BATCHES, default 300 per round; ROUNDS, default 4, the first one a warm-up)

W1's steady state: a scratch database gets enough no-op runs; one worker-session pool of one
connection (the writer told so: no_jit=False) claims 10, then writes their outcomes in batches
of 10 through OutcomeWriter._statement, each batch's refill claiming the next 10 in the same
trip (finish_runs, lock_tenants, claim_runs: a busy worker's refill neither reaps nor
promotes). Prints process CPU (user + system) and wall time per batch for each round.

Instructions, which load does not move: run it under valgrind twice, e.g.
    BATCHES=40 ROUNDS=1 valgrind --tool=callgrind python docs/batch_cpu.py DSN
    BATCHES=240 ROUNDS=1 valgrind --tool=callgrind python docs/batch_cpu.py DSN
and take (Ir(240) - Ir(40)) / 200: the start-up (imports, the scratch database) cancels out.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import uuid
from typing import Any

from runpool.claiming import claim, claim_statements
from runpool.db import connect
from runpool.enqueue import RunSpec, enqueue_many
from runpool.outcomes import OutcomeWriter, Pending, from_result
from runpool.pools import open_pool
from runpool.testing.databases import scratch_database

BATCHES = int(os.environ.get("BATCHES", "300"))
ROUNDS = int(os.environ.get("ROUNDS", "4"))
SIZE = 10


class _Refill:
    def __init__(self) -> None:
        self.worker_id = uuid.uuid4()
        self.handed: list[Any] = []

    def capacity(self, freed: int) -> int:
        return SIZE

    async def statements(self, conn: Any, limit: int) -> Any:
        return await claim_statements(conn, limit=limit, worker_id=self.worker_id,
                                      lease_seconds=60, reap_expired=False, promote=False,
                                      handlers=["noop"])

    def started(self, claimed: list[Any], sent: float) -> None:
        self.handed = claimed


async def _batches(dsn: str) -> None:
    pool = await open_pool(dsn, size=1, name="batch-cpu")
    try:
        refill = _Refill()
        writer = OutcomeWriter(pool, worker_id=uuid.uuid4(), refill=refill, via="prepared")
        loop = asyncio.get_running_loop()
        async with pool.connection() as conn:
            claimed = await claim(conn, limit=SIZE, via="prepared", worker_id=refill.worker_id,
                                  lease_seconds=60, handlers=["noop"])
        for round_ in range(ROUNDS):
            cpu, wall = time.process_time(), time.perf_counter()
            for _ in range(BATCHES):
                batch = [Pending(from_result(r.id, r.attempt, None, max_bytes=1 << 20), False,
                                 loop.create_future()) for r in claimed]
                await writer._statement(batch, SIZE)
                claimed = refill.handed
                assert len(claimed) == SIZE
            print(f"round {round_}: cpu {(time.process_time() - cpu) / BATCHES * 1e6:.0f}"
                  f" us/batch, wall {(time.perf_counter() - wall) / BATCHES * 1e6:.0f} us/batch",
                  flush=True)
    finally:
        await pool.close()


def main() -> None:
    with scratch_database(sys.argv[1]) as dsn:
        with connect(dsn) as conn:
            enqueue_many(conn, [RunSpec("t", "noop")
                                for _ in range(SIZE * (BATCHES * ROUNDS + 2))])
            conn.commit()
        asyncio.run(_batches(dsn))


if __name__ == "__main__":
    main()
