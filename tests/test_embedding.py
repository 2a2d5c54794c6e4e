"""runpool.Pool inside one asyncio program: real database, real runs, no fork, no signal
handlers, no tracer provider taken over; drain finishes or releases what is in flight."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from psycopg.rows import dict_row

import runpool
from runpool.db import aconnect
from runpool.testing.pools import load_stretch
from runpool.worker import Worker
from tests.helpers import ROOT, assert_invariants, pool_env, until

# The host application's own handlers (an embedded pool takes an App object).
app = runpool.App()


def shout(arguments: Any, key: str) -> Any:
    return arguments["text"].upper()


@app.handler("echo")
async def echo(run: runpool.Run) -> Any:
    loud = await run.tool("c1", "shout", {"text": run.input["text"]}, shout)
    await run.add_message("assistant", loud)
    return {"echo": loud, "pid": os.getpid()}


@app.handler("echo_sync")
def echo_sync(run: runpool.Run) -> Any:
    return {"echo": run.tool_sync("c1", "shout", {"text": run.input["text"]}, shout)}


@app.handler("wait")
async def wait(run: runpool.Run) -> Any:
    await asyncio.sleep(float(run.input["seconds"]))
    return {"waited": run.input["seconds"]}


SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP, signal.SIGCHLD)


async def statuses(c: psycopg.AsyncConnection[Any], ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
    cur = await c.execute("SELECT id, status FROM runpool.runs WHERE id = ANY(%s)", (ids,))
    return dict(await cur.fetchall())


async def row(c: psycopg.AsyncConnection[Any], run_id: uuid.UUID) -> dict[str, Any]:
    cur = c.cursor(row_factory=dict_row)
    await cur.execute("SELECT * FROM runpool.runs WHERE id = %s", (run_id,))
    found = await cur.fetchone()
    assert found is not None
    return found


def children() -> set[int]:
    """This process's child processes (Linux /proc: every thread lists its own)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def test_embedded_pool__runs_runs_in_the_hosts_loop_touching_nothing_process_wide(
        conn: psycopg.Connection, dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # With an OTLP endpoint configured, a worker process builds and installs a provider; an
    # embedded pool must not: the global provider is the host's business.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    ids = [runpool.enqueue(conn, "acme", "echo", {"text": f"hi {i}"}) for i in range(6)]
    ids += [runpool.enqueue(conn, "globex", "echo_sync", {"text": "sync"})]

    def process_wide() -> tuple[Any, ...]:
        wakeup_fd = signal.set_wakeup_fd(-1)  # read it (and put it back): add_signal_handler
        signal.set_wakeup_fd(wakeup_fd)       # would have set one
        return ({s: signal.getsignal(s) for s in SIGNALS}, wakeup_fd,
                trace.get_tracer_provider(), children(), gc.get_threshold(),
                gc.get_freeze_count())

    async def main() -> None:
        before = process_wide()  # in the loop: asyncio.run installs its own SIGINT handler
        host_ticks = 0

        async def host_work() -> None:  # the application's own work goes on meanwhile
            nonlocal host_ticks
            while True:
                await asyncio.sleep(0.01)
                host_ticks += 1

        ticker = asyncio.create_task(host_work())
        async with await aconnect(dsn, autocommit=True) as c:
            async with runpool.Pool(app, dsn=dsn, concurrency=3, poll_seconds=0.2) as pool:
                ticks_at_start = host_ticks
                assert isinstance(pool.worker_id, uuid.UUID)
                done = await until(lambda: _all_succeeded(c, ids), "every run")
                assert done
                assert process_wide() == before
                cur = await c.execute(
                    "SELECT count(*) FROM runpool.workers WHERE id = %s AND stopped_at IS NULL",
                    (pool.worker_id,))
                assert await cur.fetchone() == (1,)
                # The host's own task ran while the pool served (how often depends on how
                # fast the runs went: CI saw 7 ticks in all on a loaded machine).
                assert host_ticks > ticks_at_start
            first = await row(c, ids[0])
            assert first["result"] == {"echo": "HI 0", "pid": os.getpid()}
            assert (await row(c, ids[-1]))["result"] == {"echo": "SYNC"}
            cur = await c.execute("SELECT stopped_at IS NOT NULL FROM runpool.workers")
            assert await cur.fetchall() == [(True,)]
        ticker.cancel()
        assert process_wide() == before

    asyncio.run(main())
    assert_invariants(conn)


async def _all_succeeded(c: psycopg.AsyncConnection[Any], ids: list[uuid.UUID]) -> bool:
    return set((await statuses(c, ids)).values()) == {"succeeded"}


def test_drain__finishes_what_fits_the_grace_and_releases_the_rest(
        conn: psycopg.Connection, dsn: str) -> None:
    short = runpool.enqueue(conn, "acme", "wait", {"seconds": 0.5})
    long = runpool.enqueue(conn, "acme", "wait", {"seconds": 60})

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            pool = runpool.Pool(app, dsn=dsn, concurrency=4, grace_seconds=2,
                                poll_seconds=0.2)
            async with pool:
                await until(lambda: _both_running(c, [short, long]), "both runs started")
                # The claim's commit is seen here a moment before the pool has read its answer
                # and started the runs (CI once found 0 in flight right after).
                await until(lambda: pool.in_flight == 2, "both runs in the pool's slots")
                started = time.monotonic()
                await pool.drain()
                took = time.monotonic() - started
                assert pool.in_flight == 0
            # The short run finished within the grace; the long one went back to the queue
            # at the grace's end, its attempt not counted against max_attempts.
            assert 1.5 < took < 10, took
            assert (await row(c, short))["status"] == "succeeded"
            released = await row(c, long)
            assert (released["status"], released["lease_expires_at"]) == ("queued", None)
            cur = await c.execute("SELECT kind FROM runpool.run_events WHERE run_id = %s"
                                  " ORDER BY id", (long,))
            assert [k for (k,) in await cur.fetchall()][-1] == "released"

    asyncio.run(main())
    assert_invariants(conn, all_terminal=False)


def test_host_cancelled__in_flight_runs_released_at_once(conn: psycopg.Connection,
                                                         dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "wait", {"seconds": 60})

    async def main() -> None:
        async def host() -> None:
            async with runpool.Pool(app, dsn=dsn, concurrency=2, grace_seconds=30,
                                    poll_seconds=0.2):
                await asyncio.Event().wait()  # the host's own work, until it is cancelled

        task = asyncio.create_task(host())
        async with await aconnect(dsn, autocommit=True) as c:
            await until(lambda: _both_running(c, [run_id]), "the run started")
            started = time.monotonic()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # Not the 30 s grace: a host shutting down is not held up by a run.
            assert time.monotonic() - started < 10
            released = await row(c, run_id)
            assert (released["status"], released["attempt"]) == ("queued", 1)

    asyncio.run(main())
    assert_invariants(conn, all_terminal=False)


async def _both_running(c: psycopg.AsyncConnection[Any], ids: list[uuid.UUID]) -> bool:
    return set((await statuses(c, ids)).values()) == {"running"}


def test_tracer_provider__the_given_one_gets_every_span(conn: psycopg.Connection,
                                                        dsn: str) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    run_id = runpool.enqueue(conn, "acme", "echo", {"text": "traced"})
    global_before = trace.get_tracer_provider()

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            async with runpool.Pool(app, dsn=dsn, concurrency=2, poll_seconds=0.2,
                                    tracer_provider=provider):
                await until(lambda: _all_succeeded(c, [run_id]), "the run")

    asyncio.run(main())
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert {"process echo", "execute_tool shout"} <= set(spans), sorted(spans)
    process = spans["process echo"]
    assert process.attributes is not None
    assert process.attributes["runpool.run.id"] == str(run_id)
    assert process.context is not None and process.context.trace_id == run_id.int
    assert trace.get_tracer_provider() is global_before


# Run in a fresh interpreter: a global tracer provider can be installed once per process.
_GLOBAL_PROVIDER_HOST = """
import asyncio, json, sys, uuid
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
import psycopg, runpool
from tests.test_embedding import app

exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
trace.set_tracer_provider(provider)  # the host application's own tracing
dsn = sys.argv[1]

async def main():
    with psycopg.connect(dsn, autocommit=True) as conn:
        run_id = runpool.enqueue(conn, "acme", "echo", {"text": "global"})
    async with runpool.Pool(app, dsn=dsn, concurrency=1, poll_seconds=0.1):
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            status = (await runpool.wait_async(aconn, run_id, timeout=float(sys.argv[2]))).status
    print(json.dumps({"status": status, "same_provider": trace.get_tracer_provider() is provider,
                      "spans": sorted(s.name for s in exporter.get_finished_spans())}))

asyncio.run(main())
"""


def test_tracer_provider__the_hosts_global_one_when_none_is_given(dsn: str) -> None:
    bound = 30 * load_stretch()  # the run's wait, and the whole host around it
    out = subprocess.run([sys.executable, "-c", _GLOBAL_PROVIDER_HOST, dsn, str(bound)],
                         env=pool_env(dsn), cwd=ROOT, capture_output=True, text=True,
                         timeout=2 * bound)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["status"] == "succeeded" and report["same_provider"]
    assert {"process echo", "execute_tool shout"} <= set(report["spans"]), report


def test_bad_arguments__runpool_errors_before_anything_starts(dsn: str,
                                                              empty_dsn: str) -> None:
    with pytest.raises(runpool.InvalidInput, match="unknown Pool option"):
        runpool.Pool(app, dsn=dsn, concurency=3)
    with pytest.raises(runpool.AppNotFound, match="cannot import app module"):
        runpool.Pool("no.such.module:app", dsn=dsn)
    with pytest.raises(runpool.InvalidInput, match="concurrency must be between"):
        runpool.Pool(app, dsn=dsn, concurrency=0)

    async def main() -> None:
        with pytest.raises(runpool.SchemaOutOfDate, match="python -m runpool migrate"):
            async with runpool.Pool("tests.apps:app", dsn=empty_dsn):
                raise AssertionError("a pool on an unmigrated database must not start")

    asyncio.run(main())


def test_a_side_task_that_swallows_its_cancellation__the_pool_still_stops(
        dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Python 3.11's wait_for (inside psycopg_pool's open) swallows a cancellation that races
    # the result it waited for; the heartbeat task then goes on. Stopping must not hang on it.
    original = Worker._heartbeat_loop

    async def swallows_one_cancel(self: Worker) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            pass
        await original(self)

    monkeypatch.setattr(Worker, "_heartbeat_loop", swallows_one_cancel)

    async def main() -> None:
        pool = runpool.Pool(app, dsn=dsn, concurrency=2, poll_seconds=0.2)
        await pool.start()
        await asyncio.wait_for(pool.drain(), 10)

    asyncio.run(main())


@pytest.mark.parametrize("case", ["no_such_database", "silent_server", "listen_dsn"])
def test_start__a_dsn_it_cannot_connect_to_raises_DatabaseUnreachable_naming_it(
        case: str, dsn: str, server_dsn: str) -> None:
    """Refused, or a server that accepts the TCP connection and never answers (past the DSN's
    connect_timeout): a ConnectionError naming the setting and PostgreSQL's reason on one line,
    and nothing registered."""
    from runpool.testing.databases import with_database

    silent = socket.create_server(("127.0.0.1", 0))  # never accepts: the handshake stalls
    missing = with_database(server_dsn, f"runpool_missing_{uuid.uuid4().hex[:8]}")
    port = silent.getsockname()[1]
    target, listen_dsn, setting, reason = {
        "no_such_database": (missing, None, "dsn (RUNPOOL_DSN)", "does not exist"),
        "silent_server": (f"postgresql://postgres@127.0.0.1:{port}/x?connect_timeout=1", None,
                          "dsn (RUNPOOL_DSN)", "timeout"),
        "listen_dsn": (dsn, missing, "listen_dsn (RUNPOOL_LISTEN_DSN)", "does not exist"),
    }[case]

    async def start() -> None:
        await runpool.Pool(app, dsn=target, listen_dsn=listen_dsn).start()

    with silent, pytest.raises(runpool.DatabaseUnreachable) as raised:
        asyncio.run(start())
    message = str(raised.value)
    assert isinstance(raised.value, ConnectionError)
    assert message.startswith(f"{setting} cannot be connected to: "), message
    assert reason in message and "\n" not in message, message
    with psycopg.connect(dsn) as conn:
        assert conn.execute("SELECT count(*) FROM runpool.workers").fetchone() == (0,)
