"""`python -m runpool demo`: a sample agent app on a real pool, across tenants and priorities."""

from __future__ import annotations

import asyncio
import random
import sys
import time
from typing import Any, Final

from .app import App
from .context import Run
from .db import connect
from .embedded import resolve_dsn
from .enqueue import RunSpec, enqueue_many
from .errors import Fail
from .migrate import migrate
from .pool_process import pool_process
from .settings import Settings
from .status import STATUSES, collect

__all__ = ["app", "run_demo"]

app = App()


@app.handler("research")
async def research(run: Run) -> Any:
    """A pretend agent: a few model turns with a tool call each."""
    topic = run.input.get("topic", "something")
    notes = []
    for turn in range(int(run.input.get("turns", 3))):
        await asyncio.sleep(random.uniform(0.05, 0.25))  # the model thinking
        if run.input.get("flaky") and run.attempt == 1 and turn == 1:
            raise ConnectionError("model provider timed out (the demo's scripted failure)")
        notes.append(f"turn {turn}: looked up {topic!r}")
    return {"topic": topic, "notes": notes, "attempt": run.attempt}


@app.handler("summarize")
def summarize(run: Run) -> Any:
    """A plain function: runpool runs it in a thread."""
    time.sleep(random.uniform(0.05, 0.15))
    text = str(run.input.get("text", ""))
    if not text:
        raise Fail("nothing to summarize")
    return {"summary": text[:40]}


TENANTS: Final = {"acme": 3, "globex": 2, "initech": None}  # quota; None: pool default


def _specs(count: int) -> list[RunSpec]:
    specs = []
    for i in range(count):
        tenant = list(TENANTS)[(i + i // 12) % len(TENANTS)]
        if i % 12 == 11:
            specs.append(RunSpec(tenant, "summarize", {"text": ""}))  # fails: nothing to do
        elif i % 12 == 5:
            specs.append(RunSpec(tenant, "translate", {}))  # no worker knows this handler
        elif i % 4 == 0:
            specs.append(RunSpec(tenant, "summarize", {"text": f"report number {i} " * 5}))
        else:
            specs.append(RunSpec(tenant, "research",
                                 {"topic": f"topic {i}", "turns": 2 + i % 3, "flaky": i % 7 == 3},
                                 priority=(i * 7) % 11 - 5))
    return specs


def run_demo(settings: Settings, *, runs: int = 36) -> int:
    dsn = resolve_dsn(settings)
    with connect(dsn, autocommit=True) as conn:
        migrate(conn)
        for tenant, quota in TENANTS.items():
            conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
        ids = enqueue_many(conn, _specs(runs))
        print(f"enqueued {len(ids)} runs for tenants {', '.join(TENANTS)}"
              f" (quotas: acme 3, globex 2, initech unlimited)\n")
        with pool_process(dsn, "runpool.demo:app", workers=2, concurrency=4,
                          retry_backoff_seconds=0.3, poll_seconds=1):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                report = collect(conn)
                line = "  ".join(f"{s} {report['totals'][s]:>3}" for s in STATUSES)
                # In place on a terminal; one line per update in a log.
                print(f"\r{line}" if sys.stdout.isatty() else line,
                      end="" if sys.stdout.isatty() else "\n", flush=True)
                if report["totals"]["queued"] + report["totals"]["running"] == 0:
                    break
                time.sleep(0.5)
            print("\n")
        for tenant, counts in collect(conn)["tenants"].items():
            print(f"  {tenant:<10} " + "  ".join(f"{s} {counts[s]}" for s in STATUSES))
        failed = conn.execute(
            "SELECT id, handler, error->>'reason' FROM runpool.runs WHERE status = 'failed'"
            " ORDER BY handler").fetchall()
        if failed:
            print(f"\n{len(failed)} failed runs (the dead-letter list;"
                  " `python -m runpool retry RUN_ID` replays one):")
            for run_id, handler, reason in failed:
                print(f"  {run_id}  {handler:<10} {reason}")
    print("\nthe pool drained and stopped; runs stay in the database for inspection.",
          file=sys.stderr)
    return 0
