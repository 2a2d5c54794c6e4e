"""What waiting costs: W2 (enqueue commit -> handler start on an idle pool), W3 (an idle
pool's transactions per second) and W9 (cancel_run commit -> the handler seeing it, with
LISTEN and without)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Final

from psycopg.conninfo import conninfo_to_dict

from ..db import connect
from ..enqueue import enqueue
from ..testing.databases import scratch_database
from .measure import (
    CLEAR_SNAPSHOT,
    COUNT_DONE,
    LIVE_WORKERS,
    XACTS,
    bench_pool,
    percentile,
    wait_until,
)

__all__ = ["w2_latency", "w3_idle", "w9_cancel_latency"]


def w2_latency(server: str, *, runs: int = 300, gap: float = 0.02) -> dict[str, Any]:
    """W2: idle pool; runs enqueued one at a time; enqueue commit -> handler start."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        with bench_pool(dsn, workers=2, concurrency=10):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            warm = enqueue(conn, "bench", "stamp")
            wait_until(conn, COUNT_DONE, 1, timeout=60)
            # Per run: when the enqueue call began, and when its commit was acknowledged.
            sent: dict[uuid.UUID, tuple[float, float]] = {}
            for _ in range(runs):
                t0 = time.time()
                run_id = enqueue(conn, "bench", "stamp")  # autocommit: returns after COMMIT
                sent[run_id] = (t0, time.time())
                time.sleep(gap)
            wait_until(conn, COUNT_DONE, runs + 1, timeout=120)
        started = dict(conn.execute(
            "SELECT id, result FROM runpool.runs WHERE id <> %s", (warm,)).fetchall())
    latencies = [(float(started[i]) - acked) * 1000 for i, (_, acked) in sent.items()]
    # The stricter view: from the moment the enqueue call began (includes its own statement).
    from_call = [(float(started[i]) - t0) * 1000 for i, (t0, _) in sent.items()]
    return {"workload": "W2", "runs": runs, "p50_ms": round(percentile(latencies, 50), 2),
            "p99_ms": round(percentile(latencies, 99), 2), "max_ms": round(max(latencies), 2),
            "p50_from_call_ms": round(percentile(from_call, 50), 2),
            "p99_from_call_ms": round(percentile(from_call, 99), 2)}


def w3_idle(server: str, *, seconds: float = 60.0) -> dict[str, Any]:
    """W3: an idle pool of 2 workers with default settings; database transactions per second."""
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn, \
            connect(server, autocommit=True) as stats:
        name = conninfo_to_dict(dsn)["dbname"]
        with bench_pool(dsn, workers=2):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            conn.close()
            time.sleep(12)  # past startup, and past the stats collector's idle flush delay
            stats.execute(CLEAR_SNAPSHOT)
            before = stats.execute(XACTS, (name,)).fetchone()
            t0 = time.monotonic()
            time.sleep(seconds)
            stats.execute(CLEAR_SNAPSHOT)
            after = stats.execute(XACTS, (name,)).fetchone()
            elapsed = time.monotonic() - t0
    assert before is not None and after is not None
    return {"workload": "W3", "seconds": seconds,
            "xact_per_s": round((after[0] - before[0]) / elapsed, 3)}


# How many of the runs are running, and how many ended cancelled (W9 waits on each).
RUNNING: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'running'"
CANCELLED: Final = "SELECT count(*) FROM runpool.runs WHERE status = 'cancelled'"


def _cancel_latencies(server: str, *, rounds: int, per_round: int, **settings: Any
                      ) -> list[float]:
    with scratch_database(server) as dsn, connect(dsn, autocommit=True) as conn:
        latencies: list[float] = []
        with bench_pool(dsn, workers=2, concurrency=per_round // 2,
                          **settings):
            wait_until(conn, LIVE_WORKERS, 2, timeout=60)
            for r in range(rounds):
                ids = [enqueue(conn, "bench", "await_cancel") for _ in range(per_round)]
                wait_until(conn, RUNNING, per_round, timeout=120)
                committed = {}
                for run_id in ids:
                    conn.execute("SELECT runpool.cancel_run(%s, 'bench')", (run_id,))
                    committed[run_id] = time.time()  # autocommit: returns after COMMIT
                wait_until(conn, CANCELLED, per_round * (r + 1), timeout=120)
                for run_id, content in conn.execute(
                        "SELECT run_id, content FROM runpool.messages WHERE run_id = ANY(%s)",
                        (ids,)):
                    latencies.append((content["seen"] - committed[run_id]) * 1000)
    return latencies


def w9_cancel_latency(server: str) -> dict[str, Any]:
    """W9: cancel_run commit -> the handler seeing the cancellation; 200 running runs with
    LISTEN, and 20 with LISTEN off (the heartbeat must bring it, default lease 30 s)."""
    notified = _cancel_latencies(server, rounds=10, per_round=20)
    polled = _cancel_latencies(server, rounds=1, per_round=20, listen=0)
    return {"workload": "W9", "cancels": len(notified),
            "p50_ms": round(percentile(notified, 50), 2),
            "p99_ms": round(percentile(notified, 99), 2),
            "no_listen_cancels": len(polled), "no_listen_max_ms": round(max(polled), 1),
            "no_listen_heartbeat_s": 10.0}
