"""The live-run benchmarks: W12 (follow and wait latency) and W13 (the cost of progress)."""

from __future__ import annotations

import asyncio
import math
import statistics
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import AbstractContextManager
from typing import Any, Final

from ..db import aconnect, connect
from ..enqueue import RunSpec, enqueue_many
from ..live import RunEvent, follow, wait_async
from ..live_hub import FollowHub
from ..testing.databases import scratch_database
from ..testing.pools import PoolProcess, running_pool
from .measure import COUNT_DONE, DRAIN_RATE, LIVE_WORKERS, percentile, wait_until

__all__ = ["w12_follow_latency", "w13_progress_cost"]


def _pool(dsn: str, app: str, **settings: Any) -> AbstractContextManager[PoolProcess]:
    return running_pool(dsn, f"runpool.harness.benchapp:{app}", stop="drain", output="discard",
                        **settings)


# When each waited run committed its end: the commit's timestamp where the server tracks them
# (track_commit_timestamp = on; nothing writes a run's row after its end), else finished_at (its
# transaction's start: the latency reported then includes that transaction and its commit).
FINISHED_AT: Final = """
SELECT id, extract(epoch FROM CASE WHEN current_setting('track_commit_timestamp') = 'on'
                                   THEN pg_xact_commit_timestamp(xmin) ELSE finished_at END)
FROM runpool.runs WHERE id = ANY(%s)
"""
COMMIT_TIMES: Final = "SELECT current_setting('track_commit_timestamp')"
RUNNING_EMITTERS: Final = ("SELECT count(*) FROM runpool.runs"
                           " WHERE handler = 'emit' AND status = 'running'")
PUBLISHED: Final = "SELECT coalesce(sum(version), 0) FROM runpool.progress"


async def _follow_delays(dsn: str, run_ids: list[uuid.UUID], *, listen: bool = True,
                         poll: float = 1.0) -> list[float]:
    """One follower (its own connection) per run; each message's delay in ms from its commit
    (acknowledged to the handler) to its delivery, once the follower has caught up."""
    async def events(run_id: uuid.UUID) -> AsyncGenerator[RunEvent, None]:
        async with await aconnect(dsn, autocommit=True) as aconn:
            async for event in follow(aconn, run_id, listen=listen, poll=poll):
                yield event

    return await _delays(run_ids, events)


async def _delays(run_ids: list[uuid.UUID],
                  events: Callable[[uuid.UUID], AsyncGenerator[RunEvent, None]]) -> list[float]:
    """Each message's delay in ms from its commit (acknowledged to the handler) to its
    delivery by `events`, once the follower has caught up; all runs followed at once."""
    async def one(run_id: uuid.UUID) -> list[float]:
        received: dict[int, float] = {}
        committed: dict[int, float] = {}
        live_since = math.inf
        async for event in events(run_id):
            live_since = min(live_since, time.time())
            if event.kind == "message":
                i, previous = event.data["content"]["i"], event.data["content"][
                    "previous_committed"]
                received[i] = time.time()
                if previous is not None:
                    committed[i - 1] = previous
        return [(received[i] - at) * 1000 for i, at in committed.items() if at > live_since]

    per_run = await asyncio.gather(*(one(r) for r in run_ids))
    return [d for delays in per_run for d in delays]


async def _hub_delays(dsn: str, run_ids: list[uuid.UUID]) -> list[float]:
    """_follow_delays with every follower in one FollowHub (one LISTEN connection, its
    default readers) instead of a connection each."""
    async with FollowHub(dsn) as hub:
        return await _delays(run_ids, hub.follow)


async def _wait_delays(dsn: str, run_ids: list[uuid.UUID], *, listen: bool = True,
                       poll: float = 1.0) -> list[float]:
    """One waiter per run; ms from the run's terminal commit to wait_async returning."""
    async def one(run_id: uuid.UUID) -> tuple[uuid.UUID, float]:
        async with await aconnect(dsn, autocommit=True) as aconn:
            await wait_async(aconn, run_id, timeout=120, listen=listen, poll=poll)
            return run_id, time.time()

    returned = dict(await asyncio.gather(*(one(r) for r in run_ids)))
    async with await aconnect(dsn, autocommit=True) as conn:
        cur = await conn.execute(FINISHED_AT, (run_ids,))
        return [(returned[i] - float(at)) * 1000 for i, at in await cur.fetchall()]


def _summary(prefix: str, values: list[float]) -> dict[str, Any]:
    return {f"{prefix}_n": len(values), f"{prefix}_p50_ms": round(percentile(values, 50), 2),
            f"{prefix}_p99_ms": round(percentile(values, 99), 2),
            f"{prefix}_max_ms": round(max(values), 1)}


def w12_follow_latency(server: str, *, runs: int = 100, messages: int = 20, gap: float = 0.25,
                       unheard: int = 10) -> dict[str, Any]:
    """W12: `runs` runs each committing `messages` messages `gap` s apart, one follower each
    (its own connection: the server needs max_connections above runs + 30); then `runs` waiters
    on as many runs ending at random moments; then `unheard` followers and waiters that poll
    only (listen=False, poll 1 s: a lost notification's worst case)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        with _pool(dsn, "app", workers=2, concurrency=max(runs // 2, 10),
                          pool_size=6):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            beats = enqueue_many(conn, [RunSpec("bench", "beat", {"messages": messages,
                                                                  "gap": gap})] * runs)
            followed = asyncio.run(_follow_delays(dsn, beats))
            beats = enqueue_many(conn, [RunSpec("bench", "beat", {"messages": messages,
                                                                  "gap": gap})] * runs)
            hub_followed = asyncio.run(_hub_delays(dsn, beats))
            # Ends 20 ms apart: one waiter woken at a time, as in a service whose clients
            # each wait for their own run (not a batch of waiters in one process at once).
            sleeps = enqueue_many(conn, [RunSpec("bench", "sleep", {"seconds": 0.5 + i / 50})
                                         for i in range(runs)])
            waited = asyncio.run(_wait_delays(dsn, sleeps))
            beats = enqueue_many(conn, [RunSpec("bench", "beat", {"messages": 5, "gap": 0.7})]
                                 * unheard)
            polled = asyncio.run(_follow_delays(dsn, beats, listen=False))
            sleeps = enqueue_many(conn, [RunSpec("bench", "sleep", {"seconds": 0.5 + i / 7})
                                         for i in range(unheard)])
            polled_wait = asyncio.run(_wait_delays(dsn, sleeps, listen=False))
        clock = "commit" if conn.execute(COMMIT_TIMES).fetchone() == ("on",) else "finished_at"
    return {"workload": "W12", "followers": runs, **_summary("follow", followed),
            **_summary("hub_follow", hub_followed),
            "wait_from": clock,
            **_summary("wait", waited), "no_listen_poll_s": 1.0,
            "no_listen_follow_max_ms": round(max(polled), 1),
            "no_listen_wait_max_ms": round(max(polled_wait), 1)}


def _w1_beside_emitters(server: str, *, runs: int, emitters: int, rate: float) -> dict[str, Any]:
    """W1's drain (2 workers x 10) while `emitters` runs on a pool of their own each emit `rate`
    progress events a second (0: the same runs, silent)."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        seconds = 600.0
        with _pool(dsn, "progress_app", workers=2,
                          concurrency=emitters // 2, pool_size=4):
            enqueue_many(conn, [RunSpec("bench", "emit", {"rate": rate, "seconds": seconds})]
                         * emitters)
            wait_until(conn, RUNNING_EMITTERS, emitters, timeout=60)
            time.sleep(1.0)  # the emitters reach their pace
            published = float(conn.execute(PUBLISHED).fetchone()[0])  # type: ignore[index]
            enqueue_many(conn, [RunSpec("bench", "noop")] * runs)
            began = time.monotonic()
            with _pool(dsn, "app", workers=2, concurrency=10):
                wait_until(conn, COUNT_DONE, runs, timeout=900)
            elapsed = time.monotonic() - began
            published = float(conn.execute(PUBLISHED).fetchone()[0]) - published  # type: ignore[index]
            drain = float(conn.execute(DRAIN_RATE).fetchone()[0])  # type: ignore[index]
            conn.execute("SELECT runpool.cancel_run(id) FROM runpool.runs WHERE handler = 'emit'")
    return {"runs_per_s": drain, "published_per_s": published / elapsed}


def w13_progress_cost(server: str, *, runs: int = 10_000, emitters: int = 200,
                      rate: float = 20.0, rounds: int = 2) -> dict[str, Any]:
    """W13: W1-style throughput beside 200 runs emitting 20 progress events a second each, and
    beside the same runs silent; alternated `rounds` times (the machine is shared), medians."""
    silent, loud = [], []
    for _ in range(rounds):
        silent.append(_w1_beside_emitters(server, runs=runs, emitters=emitters, rate=0))
        loud.append(_w1_beside_emitters(server, runs=runs, emitters=emitters, rate=rate))
    base = statistics.median(r["runs_per_s"] for r in silent)
    with_progress = statistics.median(r["runs_per_s"] for r in loud)
    published = statistics.median(r["published_per_s"] for r in loud)
    return {"workload": "W13", "runs": runs, "emitters": emitters,
            "offered_per_s": emitters * rate, "published_per_s": round(published, 1),
            "runs_per_s_silent": round(base, 1), "runs_per_s_progress": round(with_progress, 1),
            "ratio": round(with_progress / base, 3)}
