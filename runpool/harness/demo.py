"""`python -m runpool demo`: the sample agent on a real pool, across tenants and priorities —
one run followed live (runpool.follow), a worker killed mid-run (the run resumes from its
checkpoints) and a run cancelled; and the second sample, an agent that waits (out of its slot)
for a person's approval, which the demo gives from another process (`python -m runpool
signal`)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import Any, Final

import psycopg

from ..app import App
from ..context import Run
from ..db import aconnect, connect
from ..embedded import resolve_dsn
from ..enqueue import RunSpec, enqueue_many
from ..errors import Fail
from ..live import follow
from ..live_cli import render_event
from ..migrate import migrate
from ..settings import Settings
from ..status import STATUSES
from ..testing.pools import Stretched, running_pool
from . import approval_agent, sample_agent

__all__ = ["app", "run_demo"]

# The sample agent plus one plain (threaded) handler.
app = App()
app.handler("research")(sample_agent.research)
app.handler("guarded_delete")(approval_agent.guarded_delete)


@app.handler("summarize")
def summarize(run: Run) -> Any:
    """A plain function: runpool runs it in a thread."""
    time.sleep(random.uniform(0.05, 0.15))
    text = str(run.input.get("text", ""))
    if not text:
        raise Fail("nothing to summarize")
    return {"summary": text[:40]}


TENANTS: Final = {"acme": 3, "globex": 2, "initech": None}  # quota; None: pool default

# This demo's runs by tenant and status (earlier demos' runs stay in the same database).
PROGRESS: Final = """
SELECT tenant, status, count(*) FROM runpool.runs WHERE id = ANY(%s)
GROUP BY tenant, status ORDER BY tenant
"""
# A running agent run and the pid of the worker holding it.
HOLDER: Final = """
SELECT r.id, w.pid FROM runpool.runs r JOIN runpool.workers w ON w.id = r.worker_id
WHERE r.id = ANY(%s) AND r.status = 'running' AND r.handler = 'research'
  AND (SELECT count(*) FROM runpool.tool_calls t WHERE t.run_id = r.id) >= 1
ORDER BY r.started_at LIMIT 1
"""
# This demo's runs still waiting, by handler.
WAITING: Final = """
SELECT handler, array_agg(id ORDER BY created_at) FROM runpool.runs
WHERE id = ANY(%s) AND status IN ('queued', 'running') GROUP BY handler
"""


def _specs(count: int) -> list[RunSpec]:
    specs = []
    for i in range(count):
        tenant = list(TENANTS)[(i + i // 12) % len(TENANTS)]
        if i % 12 == 11:
            specs.append(RunSpec(tenant, "summarize", {"text": ""}))  # fails: nothing to do
        elif i % 12 == 5:
            specs.append(RunSpec(tenant, "translate", {}))  # no pool serves this handler
        elif i % 4 == 0:
            specs.append(RunSpec(tenant, "summarize", {"text": f"report number {i} " * 5}))
        else:
            specs.append(RunSpec(tenant, "research",
                                 {"topic": f"topic {i}", "searches": 2 + i % 3,
                                  "think_seconds": 0.15, "tool_seconds": 0.15},
                                 priority=(i * 7) % 11 - 5))
    return specs


def _say(text: str) -> None:
    print(f"\n>>> {text}", flush=True)


def run_demo(settings: Settings, *, runs: int = 36) -> int:
    dsn = resolve_dsn(settings)
    with connect(dsn, autocommit=True) as conn:
        migrate(conn)
        sample_agent.prepare(conn)
        for tenant, quota in TENANTS.items():
            conn.execute("SELECT runpool.set_tenant_quota(%s, %s)", (tenant, quota))
        ids = enqueue_many(conn, _specs(runs))
        guarded = enqueue_many(conn, [RunSpec("acme", "guarded_delete", {"customer": "c-42"})])[0]
        ids.append(guarded)
        print(f"enqueued {len(ids)} runs for tenants {', '.join(TENANTS)}"
              " (quotas: acme 3, globex 2, initech unlimited), one of them an agent that"
              " asks for approval before deleting records")
        approved = False
        followed = _follow_one(dsn, conn, ids)
        killed: tuple[uuid.UUID, int] | None = None
        cancelled: uuid.UUID | None = None
        unserved: list[uuid.UUID] = []
        with running_pool(dsn, "runpool.harness.demo:app", stop="drain", output="discard",
                          workers=2, concurrency=4, retry_backoff_seconds=0.3, poll_seconds=1,
                          lease_seconds=3):
            # Three minutes of a machine with a CPU to spare, longer on a loaded one.
            deadline = Stretched(180)
            while not deadline.expired():
                tenants = _progress(conn, ids)
                totals = {s: sum(t[s] for t in tenants.values()) for s in STATUSES}
                line = "  ".join(f"{s} {totals[s]:>3}" for s in STATUSES)
                print(f"\r{line}" if sys.stdout.isatty() else line,
                      end="" if sys.stdout.isatty() else "\n", flush=True)
                if killed is None:
                    killed = _kill_a_worker(conn, ids)
                elif cancelled is None:
                    cancelled = _cancel_a_run(conn, ids, killed[0])
                if not approved:
                    approved = _approve(conn, dsn, guarded)
                if totals["queued"] + totals["running"] + totals["waiting"] == 0:
                    break
                if not unserved:
                    unserved = _cancel_unserved(conn, ids)
                time.sleep(0.5)
            print()
            if followed is not None:
                followed.join(timeout=30)
        _summary(conn, ids, killed, cancelled)
        _approval_summary(conn, guarded)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        _say("traces were exported to " + os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
             + ": in Jaeger, find the killed run's trace by its runpool.run.id; both attempts"
             " are in it, with checkpoint-hit events where attempt 2 resumed")
    print("\nthe pool drained and stopped; runs stay in the database for inspection"
          " (python -m runpool status, python -m runpool runs RUN_ID).", file=sys.stderr)
    return 0


def _follow_one(dsn: str, conn: psycopg.Connection[Any], ids: list[uuid.UUID]
                ) -> threading.Thread | None:
    """Follow the first agent run live, as an API's client would (an SSE stream, say): its
    status changes, messages, tool calls and progress, printed as they are committed."""
    row = conn.execute("SELECT id FROM runpool.runs WHERE id = ANY(%s) AND handler ="
                       " 'research' ORDER BY priority DESC, created_at LIMIT 1", (ids,)).fetchone()
    if row is None:
        return None
    run_id = uuid.UUID(str(row[0]))

    async def watch() -> None:
        async with await aconnect(dsn, autocommit=True) as aconn:
            async for event in follow(aconn, run_id):
                print(f"    live {str(run_id)[:8]} {render_event(event)}"[:160], flush=True)

    _say(f"following run {run_id} live: async for event in runpool.follow(aconn, run_id)")
    thread = threading.Thread(target=asyncio.run, args=(watch(),), name="runpool-demo-follow",
                              daemon=True)
    thread.start()
    return thread


def _progress(conn: psycopg.Connection[Any], ids: list[uuid.UUID]) -> dict[str, dict[str, int]]:
    tenants: dict[str, dict[str, int]] = {}
    for tenant, status, count in conn.execute(PROGRESS, (ids,)):
        tenants.setdefault(tenant, dict.fromkeys(STATUSES, 0))[status] = count
    return tenants


def _kill_a_worker(conn: psycopg.Connection[Any], ids: list[uuid.UUID]
                   ) -> tuple[uuid.UUID, int] | None:
    row = conn.execute(HOLDER, (ids,)).fetchone()
    if row is None:
        return None
    run_id, pid = row
    _say(f"SIGKILL worker pid {pid} while it runs agent run {run_id}")
    os.kill(pid, signal.SIGKILL)
    return run_id, pid


def _cancel_a_run(conn: psycopg.Connection[Any], ids: list[uuid.UUID],
                  killed: uuid.UUID) -> uuid.UUID | None:
    """Cancel a running research run, not the one whose worker was killed (its resume is the
    other half of the story: with few runs it was often the only one running)."""
    row = conn.execute("SELECT id FROM runpool.runs WHERE id = ANY(%s) AND id <> %s"
                       " AND status = 'running' AND handler = 'research'"
                       " ORDER BY started_at DESC LIMIT 1", (ids, killed)).fetchone()
    if row is None:
        return None
    answer = conn.execute("SELECT runpool.cancel_run(%s, 'user pressed stop')",
                          (row[0],)).fetchone()
    _say(f"SELECT runpool.cancel_run('{row[0]}', 'user pressed stop') -> "
         f"{answer[0] if answer else None}")
    return uuid.UUID(str(row[0]))


def _approve(conn: psycopg.Connection[Any], dsn: str, run_id: uuid.UUID) -> bool:
    """Once the approval agent waits: say what it waits for, and approve it from another
    process, as a person's review UI would."""
    row = conn.execute("SELECT runpool.explain_run(%s)", (run_id,)).fetchone()
    if row is None or row[0] is None or row[0]["status"] != "waiting":
        return False
    _say(f"the approval agent {run_id} left its slot: explain_run -> {row[0]['summary']}")
    command = [sys.executable, "-m", "runpool", "signal", str(run_id), approval_agent.SIGNAL,
               "--payload", json.dumps({"approved": True, "by": "ops@example.com"}),
               "--dsn", dsn]
    answer = subprocess.run(command, capture_output=True, text=True, timeout=60)
    _say(f"python -m runpool signal {run_id} {approval_agent.SIGNAL} --payload"
         f" '{{\"approved\": true, ...}}' -> {answer.stdout.strip() or answer.stderr.strip()}")
    return True


def _approval_summary(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> None:
    row = conn.execute("SELECT status, result, attempt FROM runpool.runs WHERE id = %s",
                       (run_id,)).fetchone()
    effects = conn.execute("SELECT tool, count(*) FROM sample_agent_effects WHERE run_id = %s"
                           " GROUP BY tool ORDER BY tool", (run_id,)).fetchall()
    _say(f"the approval agent: {row[0] if row else '?'} {row[1] if row else ''} in attempt"
         f" {row[2] if row else '?'}; tool executions: "
         + ", ".join(f"{tool} {n}x" for tool, n in effects)
         + " (the lookup before the wait ran once: the resume read it back)")


def _cancel_unserved(conn: psycopg.Connection[Any], ids: list[uuid.UUID]) -> list[uuid.UUID]:
    """Once only runs of handlers the demo's pool does not serve are left: they wait (a handler
    missing during a deploy must not dead-letter good runs), so explain one and cancel them."""
    waiting = dict(conn.execute(WAITING, (ids,)).fetchall())
    if not waiting or any(app.get(handler) for handler in waiting):
        return []
    cancelled: list[uuid.UUID] = []
    for handler, runs in sorted(waiting.items()):
        answer = conn.execute("SELECT runpool.explain_run(%s)", (runs[0],)).fetchone()
        summary = answer[0]["summary"] if answer and answer[0] else None
        _say(f"{len(runs)} {handler} runs wait: no pool here serves {handler!r}."
             f" explain_run('{runs[0]}') -> {summary}")
        for run_id in runs:
            conn.execute("SELECT runpool.cancel_run(%s, %s)",
                         (run_id, f"no pool serves {handler}"))
        _say(f"cancelled them: runpool.cancel_run(id, 'no pool serves {handler}')")
        cancelled.extend(uuid.UUID(str(r)) for r in runs)
    return cancelled


def _summary(conn: psycopg.Connection[Any], ids: list[uuid.UUID],
             killed: tuple[uuid.UUID, int] | None, cancelled: uuid.UUID | None) -> None:
    for tenant, counts in _progress(conn, ids).items():
        print(f"  {tenant:<10} " + "  ".join(f"{s} {counts[s]}" for s in STATUSES))
    if killed:
        run_id, _ = killed
        row = conn.execute("SELECT status, attempt FROM runpool.runs WHERE id = %s",
                           (run_id,)).fetchone()
        calls = conn.execute(
            "SELECT t.call_id, t.status, (SELECT count(*) FROM sample_agent_effects e"
            " WHERE e.run_id = t.run_id AND e.call_id = t.call_id)"
            " FROM runpool.tool_calls t WHERE t.run_id = %s ORDER BY t.started_at",
            (run_id,)).fetchall()
        _say(f"the run whose worker was killed: {row[0] if row else '?'} after"
             f" {row[1] if row else '?'} attempts; its tool calls (status, executions):")
        for call_id, status, executions in calls:
            why = ("  <- in flight when the worker died; safe to retry, so it ran again"
                   if executions > 1 else "")
            print(f"      {call_id:<10} {status:<10} ran {executions}x{why}")
        print("      (calls committed before the kill were not run again: resume read them back)")
    if cancelled:
        row = conn.execute("SELECT status, cancel_reason FROM runpool.runs WHERE id = %s",
                           (cancelled,)).fetchone()
        _say(f"the cancelled run: {row[0] if row else '?'} ({row[1] if row else ''})")
    failed = conn.execute(
        "SELECT id, handler, error->>'reason' FROM runpool.runs WHERE id = ANY(%s)"
        " AND status = 'failed' ORDER BY handler", (ids,)).fetchall()
    if failed:
        _say(f"{len(failed)} failed runs (the dead-letter list;"
             " `python -m runpool retry RUN_ID` replays one):")
        for run_id, handler, reason in failed:
            print(f"      {run_id}  {handler:<10} {reason}")
