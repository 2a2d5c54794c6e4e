"""Live runs: runpool.wait / wait_async / follow and run.progress, against real pools."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from contextlib import aclosing
from typing import Any

import psycopg
import pytest

import runpool
from runpool import live, live_io
from runpool.db import aconnect, connect
from runpool.enqueue import enqueue

from .helpers import ROOT, live_workers, migrate_below, pool_env, running_pool, status_of, wait_for

TERMINAL = {"succeeded", "failed", "cancelled"}


async def _collect(dsn: str, run_id: uuid.UUID, after: int = 0, *, stop_after: int | None = None,
                   **options: Any) -> list[runpool.RunEvent]:
    """The stored events a follower gets (progress left out), up to `stop_after` of them."""
    got: list[runpool.RunEvent] = []
    async with await aconnect(dsn, autocommit=True) as aconn:
        async with aclosing(runpool.follow(aconn, run_id, after, **options)) as stream:
            async for event in stream:
                if event.kind != "progress":
                    got.append(event)
                if stop_after is not None and len(got) >= stop_after:
                    break
        # The follower left no LISTEN behind and no transaction open.
        cur = await aconn.execute("SELECT count(*) FROM pg_listening_channels()")
        assert (await cur.fetchone()) == (0,)
    return got


def _check_stream(events: list[runpool.RunEvent]) -> None:
    seqs = [e.seq for e in events]
    assert seqs == sorted(set(seqs)), f"seq not strictly increasing: {seqs}"
    assert events[0].kind == "status" and events[0].data["status"] == "queued"
    assert events[-1].kind == "status" and events[-1].data["status"] in TERMINAL


def test_follow__live_replay_and_a_resumed_stream_agree_nothing_missed_nothing_twice(
        dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        run_id = enqueue(conn, "acme", "chatty", {"steps": 6, "gap": 0.05})

        async def main() -> tuple[list[runpool.RunEvent], list[runpool.RunEvent]]:
            # The stream is cut after 4 events (the client went away), then resumed after
            # the last seq it saw, on a new connection.
            first = await _collect(dsn, run_id, stop_after=4)
            rest = await _collect(dsn, run_id, after=first[-1].seq)
            return first, rest

        first, rest = asyncio.run(main())
        replay = asyncio.run(_collect(dsn, run_id))
        assert status_of(conn, run_id) == "succeeded"
    assert first + rest == replay
    _check_stream(replay)
    kinds = [(e.kind, e.data.get("status", e.data.get("role"))) for e in replay]
    assert kinds.count(("message", "assistant")) == 6
    assert kinds.count(("tool_call", "started")) == 6
    assert kinds.count(("tool_call", "succeeded")) == 6
    assert kinds.count(("message", "tool")) == 6
    assert [k for k in kinds if k[0] == "status"] == [
        ("status", "queued"), ("status", "running"), ("status", "succeeded")]
    # Each call's start comes before its commit, and its commit before its tool message.
    order = [(e.data.get("call_id"), e.data["status"]) for e in replay if e.kind == "tool_call"]
    for i in range(6):
        assert order.index((f"c{i}", "started")) < order.index((f"c{i}", "succeeded"))
    # Resuming after the end delivers nothing more and ends at once.
    assert asyncio.run(_collect(dsn, run_id, after=replay[-1].seq)) == []


def test_follow__a_workers_checkpoint_writes_wake_the_follower_long_before_its_poll(
        dsn: str) -> None:
    """A worker's checkpoint writes go in batch statements that ring no doorbell; the worker
    rings the run's after they commit (runpool.doorbells). A follower whose next poll is a
    minute away hears the run's message and tool call while the run still runs."""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "chatty", {"steps": 2, "gap": 120})

        async def main() -> list[runpool.RunEvent]:
            async with await aconnect(dsn, autocommit=True) as aconn:
                stream = runpool.follow(aconn, run_id, poll=60)
                # Read (and listening) before any worker runs: what follows must be rung.
                first = await anext(stream)
                assert first.data["status"] == "queued"
                got: list[runpool.RunEvent] = []
                with running_pool(dsn):
                    while not any(e.kind == "tool_call" and e.data["status"] == "succeeded"
                                  for e in got):
                        got.append(await asyncio.wait_for(anext(stream), 20))
                    assert status_of(conn, run_id) == "running"  # its 120 s gap has begun
                    conn.execute("SELECT runpool.cancel_run(%s)", (run_id,))
                    got.extend([e async for e in stream])
                return got

        got = asyncio.run(asyncio.wait_for(main(), 60))
    kinds = [(e.kind, e.data.get("status")) for e in got if e.kind != "progress"]
    assert ("message", None) in kinds and ("tool_call", "started") in kinds, kinds
    assert kinds[-1] == ("status", "cancelled"), kinds


def test_follow__across_a_sigkill_and_reclaim(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn, lease_seconds=2):
        run_id = enqueue(conn, "acme", "chatty", {"steps": 8, "gap": 0.3})
        killed: list[int] = []

        async def main() -> list[runpool.RunEvent]:
            got: list[runpool.RunEvent] = []
            async with await aconnect(dsn, autocommit=True) as aconn:
                async for event in runpool.follow(aconn, run_id, poll=0.5):
                    got.append(event)
                    if (not killed and event.kind == "tool_call"
                            and event.data == {"call_id": "c2", "name": "echo",
                                               "status": "succeeded", "result": {"i": 2}}):
                        # The worker dies mid-run; its lease expires, another attempt resumes.
                        [(_, pid)] = live_workers(conn)
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            return got

        got = asyncio.run(asyncio.wait_for(main(), 60))
        assert killed
    stored = [e for e in got if e.kind != "progress"]
    assert stored == asyncio.run(_collect(dsn, run_id))
    _check_stream(stored)
    statuses = [(e.data["status"], e.data["attempt"], e.data.get("reason"))
                for e in stored if e.kind == "status"]
    assert statuses == [("queued", 0, None), ("running", 1, None),
                        ("queued", 1, "lease_expired"), ("running", 2, None),
                        ("succeeded", 2, None)]


def test_follow_and_wait__unknown_runs_bad_ids_and_other_tenants(dsn: str) -> None:
    nowhere = uuid.uuid4()
    with connect(dsn, autocommit=True) as conn:
        theirs = enqueue(conn, "globex", "noop")
        with pytest.raises(runpool.NotFound):
            runpool.wait(conn, nowhere, timeout=5)
        with pytest.raises(runpool.NotFound):
            runpool.wait(conn, theirs, timeout=5, tenant="acme")
        with pytest.raises(runpool.InvalidInput):
            runpool.wait(conn, "not-a-uuid")
        with pytest.raises(runpool.InvalidInput):
            runpool.wait(conn, theirs, timeout=-1)
        with pytest.raises(runpool.InvalidInput):
            runpool.wait(conn, theirs, poll=0)
        # Inside a caller's transaction: refused (waiting would hold it open).
        conn.autocommit = False
        conn.execute("SELECT 1")
        with pytest.raises(runpool.UsageError):
            runpool.wait(conn, theirs)
        conn.rollback()
        conn.autocommit = True
        assert list(conn.execute("SELECT * FROM pg_listening_channels()")) == []

    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as aconn:
            for run_id, tenant in ((nowhere, None), (theirs, "acme")):
                with pytest.raises(runpool.NotFound):
                    async for _ in runpool.follow(aconn, run_id, tenant=tenant):
                        pass
                with pytest.raises(runpool.NotFound):
                    await runpool.wait_async(aconn, run_id, tenant=tenant)
            # The connection is still usable and listens to nothing.
            cur = await aconn.execute("SELECT count(*) FROM pg_listening_channels()")
            assert (await cur.fetchone()) == (0,)

    asyncio.run(main())


@pytest.mark.parametrize("after", [-1, 1.5, "3", True, None, 2**63, float("nan")])
def test_follow__bad_after_is_refused_before_anything_is_read(dsn: str, after: Any) -> None:
    async def main() -> None:
        async with await aconnect(dsn, autocommit=True) as aconn:
            with pytest.raises(runpool.InvalidInput, match="after"):
                async for _ in runpool.follow(aconn, uuid.uuid4(), after):
                    pass

    asyncio.run(main())


def test_wait__success_failure_cancel_and_timeout(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        ok = enqueue(conn, "acme", "noop", {"x": 1})
        bad = enqueue(conn, "acme", "fails")
        held = enqueue(conn, "acme", "hold")
        assert runpool.wait(conn, ok, timeout=30) == runpool.RunResult(
            ok, "succeeded", {"input": {"x": 1}, "attempt": 1}, None)
        failed = runpool.wait(conn, bad, timeout=30)
        assert (failed.status, failed.result) == ("failed", None)
        assert failed.error["reason"] == "failed"
        wait_for(lambda: status_of(conn, held) == "running", what="hold running")
        with pytest.raises(TimeoutError):
            runpool.wait(conn, held, timeout=0.3)

        async def cancel_while_waiting() -> runpool.RunResult:
            async with await aconnect(dsn, autocommit=True) as aconn:
                waiter = asyncio.create_task(runpool.wait_async(aconn, held, timeout=30))
                await asyncio.sleep(0.2)
                assert not waiter.done()
                conn.execute("SELECT runpool.cancel_run(%s, 'enough')", (held,))
                return await waiter

        cancelled = asyncio.run(cancel_while_waiting())
        assert (cancelled.status, cancelled.result) == ("cancelled", None)


def test_followers_on_runs_of_many_tenants_each_get_their_own_run(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn, workers=2, concurrency=10):
        runs = {enqueue(conn, f"tenant{i % 8}", "chatty", {"steps": 3, "gap": 0.02}):
                f"tenant{i % 8}" for i in range(24)}

        async def main() -> list[list[runpool.RunEvent]]:
            return await asyncio.gather(*(
                _collect(dsn, run_id, tenant=tenant) for run_id, tenant in runs.items()))

        streams = asyncio.run(asyncio.wait_for(main(), 90))
    for (run_id, _), stream in zip(runs.items(), streams, strict=True):
        _check_stream(stream)
        assert stream[-1].data["status"] == "succeeded"
        assert {e.data["content"]["run"] for e in stream
                if e.kind == "message" and e.data["role"] == "assistant"} == {str(run_id)}


def test_a_slow_follower_cannot_slow_the_run(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        run_id = enqueue(conn, "acme", "chatty", {"steps": 40, "progress": 5})

        async def main() -> list[runpool.RunEvent]:
            got: list[runpool.RunEvent] = []
            async with await aconnect(dsn, autocommit=True) as aconn:
                async for event in runpool.follow(aconn, run_id):
                    got.append(event)
                    if len(got) == 1:
                        # The follower stops reading; the run goes on to its end regardless.
                        await asyncio.to_thread(wait_for, lambda: status_of(
                            conn, run_id) == "succeeded", 30, 0.05, "the run to end")
            return got

        got = asyncio.run(main())
    stored = [e for e in got if e.kind != "progress"]
    assert stored == asyncio.run(_collect(dsn, run_id))
    assert len([e for e in stored if e.kind == "message"]) == 80


def test_progress__reaches_a_follower_coalesced_and_oversized_data_is_refused(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        run_id = enqueue(conn, "acme", "chatty", {"steps": 5, "gap": 0.3, "progress": 50})
        plain = enqueue(conn, "acme", "chatty_sync")

        async def main() -> tuple[list[runpool.RunEvent], list[runpool.RunEvent]]:
            async with await aconnect(dsn, autocommit=True) as aconn:
                got = [e async for e in runpool.follow(aconn, run_id)]
                plain_events: list[runpool.RunEvent] = []
                async for event in runpool.follow(aconn, plain):
                    plain_events.append(event)
                    if event.kind == "progress" and len(plain_events) > 3:
                        conn.execute("SELECT runpool.cancel_run(%s)", (plain,))
                return got, plain_events

        got, plain_events = asyncio.run(asyncio.wait_for(main(), 60))
        result = runpool.wait(conn, run_id).result
        # What ended runs published is forgotten (deleted by their worker's next flush).
        wait_for(lambda: not list(conn.execute("SELECT * FROM runpool.progress")),
                 what="progress rows of ended runs deleted")
    assert "9" in result["refused"] and "over the limit of 8000 bytes" in result["refused"]
    progress = [e for e in got if e.kind == "progress"]
    # 250 sent in bursts of 50: coalesced to a few per burst (progress yields to the loop, so
    # a flush may fall inside a burst: CI saw one), in order, the last of each burst its
    # latest (flushed in the 0.3 s gap after it), each carrying the seq of the last stored
    # event before it.
    assert 1 <= len(progress) < 50
    tokens: dict[int, list[int]] = {}
    for e in progress:
        tokens.setdefault(e.data["step"], []).append(e.data["token"])
    for step, seen in tokens.items():
        assert seen == sorted(seen), (step, seen)
        if step < 4 and step + 1 in tokens:
            assert seen[-1] == 49, (step, seen)
    for i, event in enumerate(got):
        if event.kind == "progress":
            assert event.seq == max([e.seq for e in got[:i] if e.kind != "progress"])
    assert any(e.kind == "progress" and "tick" in e.data for e in plain_events)


def test_delivery_without_notify_within_the_poll_interval(dsn: str, monkeypatch: Any) -> None:
    """The listener is cut (the follower listens to a channel nobody rings): follow and wait
    still deliver within poll + 1 s; a forged notification of the run's own channel is
    harmless."""
    real = live._listen
    monkeypatch.setattr(live, "_listen", lambda run_id, on: real(uuid.UUID(int=0), on))
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        run_id = enqueue(conn, "acme", "hold")
        wait_for(lambda: status_of(conn, run_id) == "running", what="hold running")

        async def main() -> float:
            async with await aconnect(dsn, autocommit=True) as aconn, \
                    await aconnect(dsn, autocommit=True) as waiter_conn:
                waiter = asyncio.create_task(runpool.wait_async(waiter_conn, run_id, poll=1))
                for _ in range(20):
                    await aconn.execute("SELECT pg_notify(%s, '')", (live.channel(run_id),))
                stream = runpool.follow(aconn, run_id, 1, poll=1)
                first = await anext(stream)  # the running status, then nothing until the end
                assert first.data["status"] == "running"
                ended = asyncio.create_task(anext(stream))
                await asyncio.sleep(0.3)
                conn.execute("SELECT runpool.cancel_run(%s)", (run_id,))
                done = await asyncio.to_thread(wait_for, lambda: status_of(
                    conn, run_id) == "cancelled", 15, 0.01, "cancelled")
                assert done
                committed = time.monotonic()
                events = [await ended] + [e async for e in stream]
                result = await waiter
                assert result.status == "cancelled"
                assert events[-1].data["status"] == "cancelled"
                return time.monotonic() - committed

        assert asyncio.run(asyncio.wait_for(main(), 30)) <= 1 + 1


def test_seq_is_commit_order_across_writers_holding_the_run_row(dsn: str) -> None:
    """A checkpoint write in an open transaction holds its seq; a status change from another
    session waits behind it and takes the next: a follower never sees seq n+1 before n."""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
        with connect(dsn) as writer, connect(dsn, autocommit=True) as api:
            writer.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                           " VALUES (%s, 1, 'assistant', '\"hi\"', 1)", (run_id,))

            def finish() -> None:
                api.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now(),"
                            " lease_expires_at = NULL WHERE id = %s", (run_id,))

            async def main() -> list[runpool.RunEvent]:
                finisher = asyncio.create_task(asyncio.to_thread(finish))
                async with await aconnect(dsn, autocommit=True) as aconn:
                    stream = runpool.follow(aconn, run_id, 2, poll=0.2)
                    pending = asyncio.create_task(anext(stream))
                    await asyncio.sleep(0.5)
                    assert not pending.done() and not finisher.done()  # both wait on the writer
                    writer.commit()
                    await finisher
                    return [await pending] + [e async for e in stream]

            got = asyncio.run(asyncio.wait_for(main(), 20))
    assert [(e.seq, e.kind) for e in got] == [(3, "message"), (4, "status")]
    assert got[1].data == {"status": "succeeded", "attempt": 1}


def _cli(dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runpool", *args], env=pool_env(dsn),
                          cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_cli_wait_exit_codes_and_runs_follow(dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn, running_pool(dsn):
        ok = enqueue(conn, "acme", "chatty", {"steps": 2})
        bad = enqueue(conn, "acme", "fails")
        held = enqueue(conn, "acme", "hold")
        follower = subprocess.Popen(
            [sys.executable, "-m", "runpool", "runs", str(ok), "--follow", "--json"],
            env=pool_env(dsn), cwd=ROOT, stdout=subprocess.PIPE, text=True)
        done = _cli(dsn, "wait", str(ok), "--timeout", "30", "--json")
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["status"] == "succeeded"
        assert _cli(dsn, "wait", str(bad), "--timeout", "30").returncode == 1
        wait_for(lambda: status_of(conn, held) == "running", what="hold running")
        timed_out = _cli(dsn, "wait", str(held), "--timeout", "0.2")
        assert timed_out.returncode == 3 and "did not finish" in timed_out.stderr
        assert _cli(dsn, "wait", str(uuid.uuid4())).returncode == 1
        out, _ = follower.communicate(timeout=30)
        assert follower.returncode == 0
    lines = [json.loads(line) for line in out.splitlines()]
    assert [d["seq"] for d in lines if d["kind"] != "progress"] == [
        e.seq for e in asyncio.run(_collect(dsn, ok))]
    assert lines[-1]["data"]["status"] == "succeeded"
    text = _cli(dsn, "runs", str(ok), "--follow")
    assert text.returncode == 0 and "echo c1 succeeded" in text.stdout


def test_progress__fenced_by_attempt_and_bounded_in_size(dsn: str) -> None:
    """A zombie attempt's progress is dropped by the database; a detached Run refuses progress;
    data over 8,000 bytes or not JSON is refused before anything is sent."""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 2,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
        publish = ("SELECT runpool.publish_progress(ARRAY[%s]::uuid[], ARRAY[%s],"
                   " ARRAY[%s::jsonb])")
        assert conn.execute(publish, (run_id, 1, '{"zombie": true}')).fetchone() == (0,)
        assert conn.execute(publish, (run_id, 2, '{"live": true}')).fetchone() == (1,)
        assert conn.execute(publish, (run_id, 2, '{"live": 2}')).fetchone() == (1,)
        assert list(conn.execute("SELECT attempt, version, data FROM runpool.progress")) == [
            (2, 2, {"live": 2})]

    async def main() -> None:
        detached = runpool.Run(id=uuid.uuid4(), tenant="acme", handler="noop", attempt=1,
                               input={})
        with pytest.raises(runpool.UsageError, match="not attached"):
            await detached.progress({"x": 1})
        sent: list[bytes] = []
        attached = runpool.Run(id=uuid.uuid4(), tenant="acme", handler="noop", attempt=1,
                               input={}, progress=lambda _id, _attempt, data: sent.append(data))
        with pytest.raises(runpool.InvalidInput, match="8000"):
            await attached.progress("x" * 8_000)
        with pytest.raises(runpool.InvalidInput, match="JSON"):
            await attached.progress({"bad": object()})
        await attached.progress("x" * 7_990)
        assert [len(d) for d in sent] == [7_992]

    asyncio.run(main())


def test_follow__a_long_history_comes_in_pages_in_order_nothing_missed(dsn: str) -> None:
    """1,200 messages with a tool call started and closed among every ten: more than a page
    of messages (live.PAGE) per read, and tool-call events on either side of each page's end."""
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))
        with conn.transaction():
            for i in range(1, 1201):
                conn.execute("INSERT INTO runpool.messages (run_id, seq, role, content, attempt)"
                             " VALUES (%s, %s, 'assistant', %s, 1)", (run_id, i, str(i)))
                if i % 10 == 0:
                    conn.execute("INSERT INTO runpool.tool_calls (run_id, call_id, name,"
                                 " arguments, status, attempt) VALUES (%s, %s, 'n', '{}',"
                                 " 'started', 1)", (run_id, f"c{i}"))
                if i % 10 == 5 and i > 10:
                    conn.execute("UPDATE runpool.tool_calls SET status = 'succeeded',"
                                 " result = '1', finished_at = now() WHERE run_id = %s"
                                 " AND call_id = %s", (run_id, f"c{i - 5}"))
        conn.execute("UPDATE runpool.runs SET status = 'succeeded', finished_at = now(),"
                     " lease_expires_at = NULL WHERE id = %s", (run_id,))
        last = conn.execute("SELECT seq FROM runpool.event_seqs WHERE run_id = %s",
                            (run_id,)).fetchone()
        assert last is not None
    got = asyncio.run(_collect(dsn, run_id))
    _check_stream(got)
    assert [e.seq for e in got] == list(range(1, last[0] + 1))  # every one, none twice
    assert [e.data["content"] for e in got if e.kind == "message"] == list(range(1, 1201))
    assert len([e for e in got if e.kind == "tool_call"]) == 120 + 119
    # Resumed from the middle of a page: exactly the rest.
    assert asyncio.run(_collect(dsn, run_id, after=777)) == [e for e in got if e.seq > 777]


def test_upgrade__runs_from_before_0009_can_be_waited_for_and_followed(empty_dsn: str) -> None:
    """A database at 0008 with finished, running and queued runs: after 0009 each run replays
    its status as of the upgrade, a finished one's follow ends, and new events number on."""
    from runpool.migrate import migrate

    with connect(empty_dsn, autocommit=True) as conn:
        migrate_below(conn, 9)
        # Through the SQL of 0008 (Python's enqueue speaks to the latest schema's).
        done, running, queued = (
            conn.execute("SELECT runpool.enqueue('acme', 'noop')").fetchone()[0]  # type: ignore[index]
            for _ in range(3))
        conn.execute("UPDATE runpool.runs SET status = 'succeeded', attempt = 1, result = '7',"
                     " finished_at = now() WHERE id = %s", (done,))
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s",
                     (running,))
        # 0009, then any later migration (0010_schedules, ...).
        assert [m.version for m in migrate(conn)][:1] == [9]
        assert runpool.wait(conn, done, timeout=5).result == 7
        conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                     " lease_expires_at = NULL WHERE id = %s", (running,))
    replays = {r: asyncio.run(_collect(empty_dsn, r)) for r in (done, running)}
    assert [(e.seq, e.data["status"]) for e in replays[done]] == [(1, "queued"), (2, "succeeded")]
    assert [(e.seq, e.data["status"]) for e in replays[running]] == [
        (1, "queued"), (2, "running"), (3, "failed")]

    async def pending() -> list[runpool.RunEvent]:
        async with await aconnect(empty_dsn, autocommit=True) as aconn:
            stream = runpool.follow(aconn, queued)
            return [await anext(stream)]

    assert [(e.seq, e.data["status"]) for e in asyncio.run(pending())] == [(1, "queued")]


def test_follow__a_killed_connection_raises_and_the_follower_resumes_where_it_was(
        dsn: str) -> None:
    with connect(dsn, autocommit=True) as conn:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute("UPDATE runpool.runs SET status = 'running', attempt = 1,"
                     " lease_expires_at = now() + interval '1 minute' WHERE id = %s", (run_id,))

        async def main() -> list[runpool.RunEvent]:
            seen: list[runpool.RunEvent] = []
            async with await aconnect(dsn, autocommit=True) as aconn:
                pid = aconn.info.backend_pid
                with pytest.raises(psycopg.OperationalError):
                    async for event in runpool.follow(aconn, run_id):
                        seen.append(event)
                        if event.seq == 2:
                            # The server ends the follower's session (a restart, a failover,
                            # an operator): the stream fails instead of hanging.
                            conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
                            conn.execute("INSERT INTO runpool.messages (run_id, seq, role,"
                                         " content, attempt) VALUES (%s, 1, 'assistant',"
                                         " '\"missed?\"', 1)", (run_id,))
                            conn.execute("UPDATE runpool.runs SET status = 'succeeded',"
                                         " finished_at = now(), lease_expires_at = NULL"
                                         " WHERE id = %s", (run_id,))
            return seen + await _collect(dsn, run_id, after=seen[-1].seq)

        got = asyncio.run(asyncio.wait_for(main(), 20))
    assert [(e.seq, e.kind) for e in got] == [
        (1, "status"), (2, "status"), (3, "message"), (4, "status")]


def test_wait_steps__one_logic_for_wait_and_wait_async() -> None:
    """wait and wait_async only perform the steps of live._waiting: a row that is not
    terminal naps `poll`, a terminal one ends the wait; a broken connection is a TimeoutError
    past the deadline and the connection's own error before it; no row is NotFound."""
    rid = uuid.uuid4()
    steps = live._waiting(rid, None, 0.5, None, listen=True)
    assert isinstance(next(steps), live_io.Read)  # the LISTEN
    assert isinstance(steps.send(None), live_io.Read)  # the status read
    assert steps.send(("running", None, None)) == live_io.Nap(0.5)
    again = steps.send(None)
    assert isinstance(again, live_io.Read) and again.query is live.RESULT
    with pytest.raises(StopIteration) as stop:
        steps.send(("succeeded", {"ok": 1}, None))
    assert stop.value.value == runpool.RunResult(rid, "succeeded", {"ok": 1}, None)

    broken = psycopg.OperationalError("connection cut")
    past = live._waiting(rid, 0, 0.5, None, listen=False)
    next(past)
    with pytest.raises(TimeoutError, match="the connection was cut"):
        past.send(broken)
    before = live._waiting(rid, 60, 0.5, None, listen=False)
    next(before)
    with pytest.raises(psycopg.OperationalError, match="connection cut"):
        before.send(broken)
    missing = live._waiting(rid, 60, 0.5, None, listen=False)
    next(missing)
    with pytest.raises(runpool.NotFound):
        missing.send(None)
