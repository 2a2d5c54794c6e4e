"""Bounded waits, pool processes and small SQL helpers shared by the tests."""

from __future__ import annotations

import asyncio
import inspect
import os
import random
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from runpool.claiming import claim
from runpool.context import Run
from runpool.db import aconnect
from runpool.queries import QUERIES
from runpool.testing import invariants, pools
from runpool.testing.pools import Stretched
from runpool.testing.pools import wait_for as wait_for  # re-exported: the tests import it from here

ROOT = Path(__file__).resolve().parent.parent


def assert_invariants(conn: psycopg.Connection[Any], **options: Any) -> invariants.Report:
    """Every reliability invariant holds for what this test's database holds (see
    runpool.invariants); run at the end of every fault scenario."""
    report = invariants.check(conn, **options)
    assert report.ok, "invariants violated:\n" + "\n".join(report.violations)
    return report


def pool_env(dsn: str, **settings: Any) -> dict[str, str]:
    """A pool's environment for the tests: none of ours leaks in (OTEL_ included), and
    `tests.apps` is importable."""
    return pools.pool_env(dsn, inherit_otel=False, pythonpath=str(ROOT), **settings)


Pool = pools.PoolProcess


def migrate_below(conn: psycopg.Connection[Any], version: int) -> None:
    """An empty database brought to the schema just before migration `version`, as an older
    runpool left it (to test the upgrade)."""
    from runpool.migrate import BOOTSTRAP, RECORD, migrations

    with conn.transaction():
        conn.execute(BOOTSTRAP)
        for m in migrations():
            if m.version < version:
                conn.execute(m.sql)
                conn.execute(RECORD, (m.version, m.name))


async def until(check: Callable[[], Any], what: str, seconds: float = 15.0,
                interval: float = 0.05) -> Any:
    """wait_for in a coroutine: poll `check` (its value, or what it returns awaited) without
    blocking the loop until it is truthy, for `seconds` stretched for load (Stretched)."""
    deadline = Stretched(seconds)
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if deadline.expired():
            raise AssertionError(f"timed out after {deadline} waiting for {what}")
        await asyncio.sleep(interval)


@contextmanager
def running_pool(dsn: str, app: str = "tests.apps:app", env: dict[str, str] | None = None,
                 **settings: Any) -> Iterator[Pool]:
    """A real `python -m runpool` supervisor; killed (with its workers) when the block exits."""
    defaults: dict[str, Any] = {"workers": 1, "concurrency": 4, "poll_seconds": 1,
                                "grace_seconds": 5}
    defaults.update(settings)
    with pools.running_pool(dsn, app, env=env, cwd=ROOT, inherit_otel=False,
                            pythonpath=str(ROOT), **defaults) as proc:
        yield proc


def run_row(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> dict[str, Any]:
    cur = conn.cursor(row_factory=psycopg.rows.dict_row)
    row = cur.execute("SELECT * FROM runpool.runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return row


def scalar(conn: psycopg.Connection[Any], query: Any, *params: Any) -> Any:
    args = params[0] if len(params) == 1 and isinstance(params[0], dict) else params
    row = conn.execute(query, args or None).fetchone()
    assert row is not None, query
    return row[0]


def status_of(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> str:
    return str(run_row(conn, run_id)["status"])


def events(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> list[str]:
    return [k for (k,) in conn.execute(
        "SELECT kind FROM runpool.run_events WHERE run_id = %s ORDER BY id", (run_id,))]


# A notification sent after the ones a test counts (see rung_before_fence).
_FENCE_PAYLOAD = "runpool-test-fence"
# Rings a fence on a channel, as its own transaction.
_FENCE = "SELECT pg_notify(%s, %s)"


def rung_before_fence(listener: psycopg.Connection[Any], dsn: str, channel: str
                      ) -> list[psycopg.Notify]:
    """Every notification `listener` got before a fence this call rings on `channel` (which
    `listener` LISTENs on). PostgreSQL delivers notifications in the order their
    transactions committed, so each ring committed before this call is counted, however
    late it arrives, and none after: no guessed window either way (10 s bound)."""
    with psycopg.connect(dsn, autocommit=True) as fencer:
        fencer.execute(_FENCE, (channel, _FENCE_PAYLOAD))
    heard: list[psycopg.Notify] = []
    for note in listener.notifies(timeout=10):
        if note.channel == channel and note.payload == _FENCE_PAYLOAD:
            return heard
        heard.append(note)
    raise AssertionError(f"the fence on {channel} did not arrive within 10 s; heard {heard}")


def live_workers(conn: psycopg.Connection[Any]) -> list[tuple[uuid.UUID, int]]:
    return list(conn.execute(
        "SELECT id, pid FROM runpool.workers WHERE stopped_at IS NULL ORDER BY started_at"))


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# -- racing claimers ----------------------------------------------------------------------

def finish_params(runs: list[tuple[uuid.UUID, int]]) -> dict[str, Any]:
    """finish_runs parameters that end each (run id, attempt) as succeeded."""
    n = len(runs)
    return {"ids": [r for r, _ in runs], "attempts": [a for _, a in runs],
            "outcomes": ["succeeded"] * n, "results": [Jsonb(None)] * n,
            "errors": [None] * n, "delays": [0.0] * n}


async def _churning_claimer(dsn: str, seed: int, max_limit: int) -> None:
    """Claims random batch sizes and finishes a random part of what it holds (runs ending at
    random), until the queue has stayed empty for three rounds. A finish answered 'busy' (its
    row held right now: another claimer's statement can lock a run it then passes over) is
    kept and written again, as a worker's outcome batch does."""
    rnd = random.Random(seed)
    async with await aconnect(dsn, autocommit=True) as c:
        held: list[tuple[uuid.UUID, int]] = []
        idle = 0
        while idle < 3:
            got = await claim(c, worker_id=uuid.uuid4(), limit=rnd.randint(1, max_limit),
                              lease_seconds=30)
            held += [(r.id, r.attempt) for r in got]
            idle = 0 if got or held else idle + 1
            rnd.shuffle(held)
            cut = rnd.randint(0, len(held))
            if cut:
                cur = await c.execute(QUERIES["finish_runs"], finish_params(held[:cut]))
                busy = {row[0] for row in await cur.fetchall() if row[2] == "busy"}
                held = [h for h in held[:cut] if h[0] in busy] + held[cut:]


def race_claimers(dsn: str, *, claimers: int, max_limit: int, probe: Any
                  ) -> tuple[list[tuple[Any, ...]], int]:
    """Race `claimers` churning claimers on separate connections while a sampler runs `probe`
    continuously on its own; returns every row the probe ever returned, and how many samples
    it took (so a test can show the sampler really watched)."""
    rows: list[tuple[Any, ...]] = []
    samples = 0
    done = asyncio.Event()

    async def sampler() -> None:
        nonlocal samples
        async with await aconnect(dsn, autocommit=True) as c:
            while not done.is_set():
                cur = await c.execute(probe)
                rows.extend(await cur.fetchall())
                samples += 1

    async def main() -> None:
        sampling = asyncio.create_task(sampler())
        await asyncio.gather(*(_churning_claimer(dsn, seed, max_limit)
                               for seed in range(claimers)))
        done.set()
        await sampling

    asyncio.run(main())
    return rows, samples


async def claim_cancelled_after(c: psycopg.AsyncConnection[Any], delay_us: int,
                                **options: Any) -> tuple[bool, list[uuid.UUID]]:
    """A claim on `c` (claiming.claim's `options`) cancelled `delay_us` after it started:
    whether the cancellation reached it, and the runs it returned if not."""
    task = asyncio.create_task(claim(c, **options))
    await asyncio.sleep(delay_us / 1e6)
    task.cancel()
    try:
        return False, [r.id for r in await task]
    except asyncio.CancelledError:
        return True, []


# A pool's LISTEN connection is up (the worker hears the doorbell): its count.
LISTENING = ("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
             " AND query ~* '^\\s*LISTEN'")


def claim_told(dsn: str, limit: int, told: list[bool]) -> list[uuid.UUID]:
    """One claim of handler noop on a connection of its own (bounded: 30 s), telling `told`
    whether it skipped a held quota'd tenant; the ids it took."""

    async def one() -> list[uuid.UUID]:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await asyncio.wait_for(claim(
                c, limit=limit, worker_id=uuid.uuid4(), lease_seconds=30, handlers=["noop"],
                on_skipped=told.append), 30)
            return [r.id for r in got]

    return asyncio.run(one())


async def agent_turns(pool: Any, group: Any, run_id: uuid.UUID, turns: int, tool: str,
                      fn: Callable[[Any, str], Any],
                      message: Callable[[int], Any] = lambda turn: {"turn": turn}) -> None:
    """An agent run as a worker's handler makes it (attempt 1 held by the caller): `turns`
    turns, each after a short random pause (seeded by the run), a tool call of `fn` and a
    message, through `group` (a CommitGroup) on `pool`."""
    run = Run(id=run_id, tenant="acme", handler="agent", attempt=1, input={}, pool=pool,
              commits=group)
    rng = random.Random(str(run_id))
    for turn in range(turns):
        await asyncio.sleep(rng.uniform(0, 0.02))
        await run.tool(f"t{turn}", tool, {"turn": turn}, fn)
        await run.add_message("assistant", message(turn))
