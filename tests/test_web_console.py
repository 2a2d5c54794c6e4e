"""The web console's pages and /metrics against a real pool and a real database, through a
real uvicorn server."""

from __future__ import annotations

import asyncio
import re
import uuid
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from runpool.claiming import claim
from runpool.db import aconnect
from runpool.web import create_app
from tests.helpers import live_workers, running_pool, status_of, wait_for
from tests.webserver import serving

JSON = {"content-type": "application/json"}


def _enqueue(conn: Any, tenant: str, handler: str, **options: Any) -> uuid.UUID:
    row = conn.execute(
        "SELECT runpool.enqueue(%(tenant)s, %(handler)s, %(input)s, run_at => %(run_at)s)",
        {"tenant": tenant, "handler": handler, "input": options.get("input", "{}"),
         "run_at": options.get("run_at")}).fetchone()
    return row[0]  # type: ignore[no-any-return]


def _cells(html: str, tenant: str) -> dict[str, str]:
    """The tenants page's row of one tenant: column name -> text."""
    row = re.search(rf'<tr data-tenant="{re.escape(tenant)}">(.*?)</tr>', html, re.S)
    assert row, f"no row for {tenant}"
    return {m[0]: re.sub(r"<[^>]+>", "", m[1]).strip()
            for m in re.findall(r'data-col="(\w+)">(.*?)</td>', row[1], re.S)}


def _schedule_row(client: httpx.Client, name: str) -> str:
    page = client.get("/schedules").text
    row = re.search(rf'<tr data-schedule="{re.escape(name)}">(.*?)</tr>', page, re.S)
    assert row, f"no row for schedule {name}"
    return re.sub(r"<[^>]+>", " ", row[1])


def _stuck_run(dsn: str, conn: Any) -> uuid.UUID:
    """A run claimed by a worker that never renews its lease (0.2 s)."""
    run_id = _enqueue(conn, "initech", "noop")

    async def take() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            got = await claim(c, worker_id=uuid.uuid4(), limit=1, lease_seconds=0.2,
                              handlers=["noop"], reap_expired=False)
            assert [r.id for r in got] == [run_id]

    asyncio.run(take())
    return run_id


def test_console_pages__tenants_in_flight_stuck_dead_letters_workers_run(dsn: str, conn
                                                                         ) -> None:
    conn.execute("SELECT runpool.set_tenant_quota('acme', 5)")
    stuck = _stuck_run(dsn, conn)
    holding = [_enqueue(conn, "acme", "hold") for _ in range(2)]
    dead = _enqueue(conn, "globex", "fails")
    later = [_enqueue(conn, "globex", "noop", run_at="2030-01-01T00:00:00Z") for _ in range(3)]
    # A handler no pool serves: it stays queued, and explain_run says why.
    unserved = _enqueue(conn, "globex", "nobody_serves_this")
    with serving(create_app(dsn)) as url, \
            httpx.Client(base_url=url, headers=JSON, timeout=20) as client:
        # No pool yet: nothing reclaims the stuck run.
        wait_for(lambda: f"/runs/{stuck}" in client.get("/stuck").text, what="a stuck run")
        assert _cells(client.get("/").text, "initech")["stuck"] == "1"
        assert "No live workers" in client.get("/workers").text

        with running_pool(dsn, concurrency=4):
            wait_for(lambda: all(status_of(conn, r) == "running" for r in holding)
                     and status_of(conn, dead) == "failed", what="runs to start and fail")
            page = client.get("/")
            assert page.status_code == 200
            assert "no-store" in page.headers["cache-control"]
            assert "script-src 'self'" in page.headers["content-security-policy"]
            acme, globex = _cells(page.text, "acme"), _cells(page.text, "globex")
            assert acme["running"] == "2" and acme["quota"].startswith("5"), acme
            assert globex["failed"] == "1" and globex["waiting"] == "3", globex
            assert globex["queued"] == "1", globex  # the unserved run: ready, never claimed

            ((_, pid),) = live_workers(conn)
            in_flight = client.get("/runs").text
            for run_id in holding:
                assert f"/runs/{run_id}" in in_flight
            assert f":{pid}</td>" in in_flight
            workers = client.get("/workers").text
            assert f":{pid}</td>" in workers and "2 / 4" in workers, workers
            dead_page = client.get("/dead").text
            assert f'data-action="retry" data-run="{dead}"' in dead_page
            assert "refused by handler" in dead_page
            assert f"/runs/{dead}" in client.get("/dead?tenant=globex").text
            assert f"/runs/{dead}" not in client.get("/dead?tenant=acme").text
            assert client.get("/dead?before=yesterday").status_code == 400

            conn.execute("SELECT runpool.set_schedule('nightly-digest', '30 2 * * *', 'acme',"
                         " 'noop', timezone => 'Europe/Berlin')")
            conn.execute("SELECT runpool.set_schedule('paused-one', '@hourly', 'globex',"
                         " 'noop', enabled => false)")
            # A pool computes next_fire_at as it finds a schedule.
            wait_for(lambda: "UTC" in _schedule_row(client, "nightly-digest"),
                     what="the schedule's next fire time")
            assert "Europe/Berlin" in _schedule_row(client, "nightly-digest")
            assert "disabled" in _schedule_row(client, "paused-one")

            explained = client.get(f"/runs/{unserved}").text
            assert "Why it is not running" in explained and "nobody_serves_this" in explained
            assert "not available until" in client.get(f"/runs/{later[0]}").text
            failed = client.get(f"/runs/{dead}").text
            assert "refused by handler" in failed and 'id="retry"' in failed
            assert client.get(f"/runs/{uuid.uuid4()}").status_code == 404
            assert client.get("/runs/not-a-run").status_code == 400

            # Retry from the dead-letter list, as its button does.
            assert client.post(f"/api/runs/{dead}/retry", json={}).json() == {
                "status": "queued"}
            wait_for(lambda: status_of(conn, dead) == "failed" and
                     "retried" in client.get(f"/runs/{dead}").text,
                     what="the retried run to fail again")


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics__queue_depth_counters_histograms_and_workers(dsn: str, conn) -> None:
    for _ in range(3):
        _enqueue(conn, "acme", "noop")
    _enqueue(conn, "acme", "fails")
    _enqueue(conn, "globex", "noop", run_at="2030-01-01T00:00:00Z")
    held = _enqueue(conn, "acme", "hold")
    app = create_app(dsn)
    app.state.web.tally.lag = 0.0  # count events as soon as they commit (the test's clock)
    with serving(app) as url, httpx.Client(base_url=url, timeout=20) as client:
        before = _samples(client.get("/metrics").text)  # the tally starts here
        assert before[("runpool_queue_depth", (("state", "ready"), ("tenant", "acme")))] == 5
        assert before[("runpool_queue_depth", (("state", "waiting"), ("tenant", "globex")))] == 1
        assert before[("runpool_workers", ())] == 0
        with running_pool(dsn, concurrency=8):
            wait_for(lambda: status_of(conn, held) == "running", what="hold to start")
            conn.execute("SELECT runpool.cancel_run(%s, 'enough')", (held,))
            wait_for(lambda: status_of(conn, held) == "cancelled", what="the cancel")

            def scraped() -> dict[Any, float]:
                got = _samples(client.get("/metrics").text)
                done = got.get(("runpool_runs_finished_total", (
                    ("handler", "noop"), ("outcome", "succeeded"), ("tenant", "acme"))))
                return got if done == 3 and got.get(("runpool_workers", ())) == 1 else {}

            after = wait_for(scraped, what="the finished runs in /metrics")
        key = (("handler", "fails"), ("outcome", "failed"), ("tenant", "acme"))
        assert after[("runpool_runs_finished_total", key)] == 1
        assert after[("runpool_runs_finished_total", (
            ("handler", "hold"), ("outcome", "cancelled"), ("tenant", "acme")))] == 1
        assert after[("runpool_run_attempts_started_total", (
            ("handler", "noop"), ("tenant", "acme")))] == 3
        assert after[("runpool_cancel_requests_total", (
            ("handler", "hold"), ("tenant", "acme")))] == 1
        assert after[("runpool_run_wait_seconds_count", (("handler", "noop"),))] == 3
        assert after[("runpool_run_duration_seconds_count", (("handler", "noop"),))] == 3
        assert after[("runpool_cancel_latency_seconds_count", ())] == 1
        assert after[("runpool_queue_depth", (("state", "ready"), ("tenant", "acme")))] == 0
        assert after[("runpool_worker_slots", ())] == 8


def test_console_dead_letters__pages_cover_every_run_once_when_many_share_a_finish_time(
        dsn: str, conn) -> None:
    # One outcome batch ends many runs at the same now(): 150 here, beside 30 older ones.
    ids = [_enqueue(conn, "acme" if i % 3 else "globex", "noop") for i in range(180)]
    conn.execute(
        "UPDATE runpool.runs SET status = 'failed', attempt = 1,"
        " error = '{\"reason\": \"handler_error\"}',"
        " finished_at = CASE WHEN id = ANY(%s) THEN '2026-01-01T00:00:00Z'::timestamptz"
        " ELSE '2025-12-31T00:00:00Z'::timestamptz END WHERE id = ANY(%s)",
        (ids[:150], ids))
    with serving(create_app(dsn)) as url, httpx.Client(base_url=url, timeout=20) as client:
        for query, expected in (("", set(ids)),
                                ("tenant=acme", {r for i, r in enumerate(ids) if i % 3})):
            seen: list[str] = []
            path: str | None = "/dead?" + query
            while path:
                page = client.get(path).text
                seen += re.findall(r'data-action="retry" data-run="([0-9a-f-]+)"', page)
                older = re.search(r'<a href="(/dead\?[^"]+)">older', page)
                path = older[1].replace("&amp;", "&") if older else None
            assert len(seen) == len(set(seen)) == len(expected)
            assert {uuid.UUID(s) for s in seen} == expected
        bad = client.get("/dead?before_id=nope")
        assert bad.status_code == 400 and "before_id" in bad.json()["error"]


def test_console__warns_of_a_session_pinning_xmin(dsn: str, conn: Any,
                                                  monkeypatch: Any) -> None:
    from runpool import health
    from runpool.db import connect

    monkeypatch.setattr(health, "XMIN_WARN_SECONDS", 0.2)
    with serving(create_app(dsn)) as url, httpx.Client(base_url=url, timeout=20) as client:
        assert 'data-warning="xmin"' not in client.get("/").text
        with connect(dsn) as holder:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM runpool.runs")
            pid = holder.info.backend_pid
            page: str = wait_for(lambda: next((t for t in [client.get("/").text]
                                               if "xmin held" in t), ""),
                                 what="the console's warning")
            (warning,) = re.findall(r'data-warning="xmin">(.*?)</p>', page)
            assert warning.startswith(f"xmin held by pid {pid} for ")
            assert warning.endswith("vacuum cannot clean the queue")
            holder.rollback()
        assert 'data-warning="xmin"' not in client.get("/").text
