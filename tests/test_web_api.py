"""runpool.web's run API through a real uvicorn server on a real database: each route, tenant
scoping, bad input (a 400 naming the field, nothing written)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import psycopg
import pytest
from starlette.requests import Request

from runpool.web import create_app
from tests.helpers import scalar, status_of
from tests.webserver import serving

JSON = {"content-type": "application/json"}


@pytest.fixture
def console(dsn: str) -> Iterator[httpx.Client]:
    """The operator app (no tenant_of), served."""
    with serving(create_app(dsn)) as url, httpx.Client(base_url=url, headers=JSON,
                                                       timeout=20) as client:
        yield client


def _tenant_from_header(request: Request) -> str | None:
    return request.headers.get("x-tenant")


async def _tenant_async(request: Request) -> str | None:
    return request.headers.get("x-tenant")


def _runs(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "SELECT count(*) FROM runpool.runs"))


def test_web_api_routes__create_read_cancel_retry(console: httpx.Client, conn) -> None:
    made = console.post("/api/runs", json={
        "tenant": "acme", "handler": "noop", "input": {"q": "ünïcode", "n": [1, 2]},
        "priority": 5, "idempotency_key": "k1", "run_at": "2030-01-01T00:00:00+00:00",
        "max_attempts": 2, "serial_key": None})
    assert made.status_code == 201, made.text
    run_id = made.json()["id"]
    # The idempotency key answers the same run.
    again = console.post("/api/runs", json={"tenant": "acme", "handler": "noop",
                                            "idempotency_key": "k1"})
    assert again.json()["id"] == run_id
    assert _runs(conn) == 1

    run = console.get(f"/api/runs/{run_id}").json()
    assert run["status"] == "queued" and run["tenant"] == "acme" and run["priority"] == 5
    assert run["input"] == {"q": "ünïcode", "n": [1, 2]} and run["max_attempts"] == 2
    assert run["attempts_left"] == 2 and run["created_at"] and run["result"] is None
    assert "rank" not in run and "serial_order" not in run  # internals stay inside

    cancelled = console.post(f"/api/runs/{run_id}/cancel", json={"reason": "changed my mind"})
    assert cancelled.json() == {"status": "cancelled"}
    assert console.get(f"/api/runs/{run_id}").json()["cancel_reason"] == "changed my mind"
    # An empty body is fine too, and a repeated cancel says what happened.
    assert console.post(f"/api/runs/{run_id}/cancel").json() == {"status": "cancelled"}
    assert console.post(f"/api/runs/{run_id}/retry").json() == {"status": "queued"}
    assert status_of(conn, uuid.UUID(run_id)) == "queued"
    assert console.post(f"/api/runs/{run_id}/retry").json() == {"status": "queued"}

    missing = uuid.uuid4()
    for path in (f"/api/runs/{missing}", ):
        assert console.get(path).status_code == 404
    for action in ("cancel", "retry"):
        answer = console.post(f"/api/runs/{missing}/{action}")
        assert answer.status_code == 404 and answer.json() == {"error": "no such run"}

    assert console.get("/healthz").text == "ok"


@pytest.mark.parametrize(("body", "field"), [
    ({"handler": "noop"}, "tenant"),
    ({"tenant": "acme"}, "handler"),
    ({"tenant": "acme", "handler": ""}, "handler"),
    ({"tenant": "a" * 201, "handler": "noop"}, "tenant"),
    ({"tenant": 7, "handler": "noop"}, "tenant"),
    ({"tenant": "acme", "handler": "noop", "priority": "high"}, "priority"),
    ({"tenant": "acme", "handler": "noop", "priority": True}, "priority"),
    ({"tenant": "acme", "handler": "noop", "priority": 101}, "priority"),
    ({"tenant": "acme", "handler": "noop", "priority": 1.5}, "priority"),
    ({"tenant": "acme", "handler": "noop", "max_attempts": 0}, "max_attempts"),
    ({"tenant": "acme", "handler": "noop", "run_at": "tomorrow"}, "run_at"),
    ({"tenant": "acme", "handler": "noop", "run_at": "2030-01-01T00:00:00"}, "run_at"),
    ({"tenant": "acme", "handler": "noop", "run_at": "9999-01-01T00:00:00Z"}, "run_at"),
    ({"tenant": "acme", "handler": "noop", "idempotency_key": ["x"]}, "idempotency_key"),
    ({"tenant": "acme", "handler": "noop", "serial_key": ""}, "serial_key"),
    ({"tenant": "acme", "handler": "noop", "input": "\u0000"}, "NUL"),
    ({"tenant": "ac\u0000me", "handler": "noop"}, "tenant"),
    ({"tenant": "acme", "handler": "noop", "input": {"blob": "x" * 1_100_000}}, "input"),
    ({"tenant": "acme", "handler": "noop", "tenat": "typo"}, "tenat"),
    ({"tenant": "acme", "handler": "noop", "timeout": "5"}, "timeout"),
    ({"tenant": "acme", "handler": "noop", "timeout": 0}, "timeout"),
    ({"tenant": "acme", "handler": "noop", "timeout": True}, "timeout"),
    ({"tenant": "acme", "handler": "noop", "deadline": "soon"}, "deadline"),
    ({"tenant": "acme", "handler": "noop", "deadline": "2030-01-01T00:00:00"}, "deadline"),
    ({"tenant": "acme", "handler": "noop", "budget": [1]}, "budget"),
    ({"tenant": "acme", "handler": "noop", "budget": {"max_tokens": -1}}, "budget.max_tokens"),
    ({"tenant": "acme", "handler": "noop", "budget": {"max_money": 1}}, "budget.max_money"),
    (["tenant", "acme"], "body"),
])
def test_web_api_bad_input__400_naming_the_field_and_nothing_written(
        console: httpx.Client, conn, body: Any, field: str) -> None:
    answer = console.post("/api/runs", json=body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"], answer.json()
    assert _runs(conn) == 0


def test_web_api_cost_options__stored_and_read_back(console: httpx.Client, conn) -> None:
    made = console.post("/api/runs", json={
        "tenant": "acme", "handler": "noop", "timeout": 2.5,
        "deadline": "2030-01-01T00:00:00+00:00", "budget": {"max_turns": 3}})
    assert made.status_code == 201, made.text
    run = console.get(f"/api/runs/{made.json()['id']}").json()
    assert run["budget"] == {"max_turns": 3} and run["usage"] is None
    assert run["deadline"].startswith("2030-01-01T00:00:00")
    assert scalar(conn, "SELECT extract(epoch FROM attempt_timeout) FROM runpool.runs") == 2.5


def test_web_api_bad_requests__clear_errors_nothing_written(console: httpx.Client, conn
                                                            ) -> None:
    assert console.post("/api/runs", content=b"{not json").status_code == 400
    # Not JSON-typed: refused (another site's form could send it), nothing written.
    plain = console.post("/api/runs", content=b'{"tenant": "a", "handler": "noop"}',
                         headers={"content-type": "text/plain"})
    assert plain.status_code == 415 and "application/json" in plain.json()["error"]
    huge = console.post("/api/runs", content=b'{"input": "' + b"x" * (9 << 20) + b'"}')
    assert huge.status_code == 413
    bad_id = console.get("/api/runs/not-a-uuid")
    assert bad_id.status_code == 400 and bad_id.json()["error"].startswith("id:")
    made = console.post("/api/runs", json={"tenant": "acme", "handler": "noop"}).json()["id"]
    reason = console.post(f"/api/runs/{made}/cancel", json={"reason": 5})
    assert reason.status_code == 400 and "reason" in reason.json()["error"]
    long = console.post(f"/api/runs/{made}/cancel", json={"reason": "r" * 2001})
    assert long.status_code == 400 and "reason" in long.json()["error"]
    assert console.post(f"/api/runs/{made}/cancel", json={"why": "x"}).status_code == 400
    assert status_of(conn, uuid.UUID(made)) == "queued"  # none of those cancelled it
    assert _runs(conn) == 1


def test_web_api_signal__stored_then_the_terminal_status_bad_names_refused(
        console: httpx.Client, conn) -> None:
    made = console.post("/api/runs", json={"tenant": "acme", "handler": "noop"}).json()["id"]
    answer = console.post(f"/api/runs/{made}/signals/approval", json={"approved": True})
    assert answer.json() == {"status": "stored"}, answer.text
    # An empty body sends {}; a name is taken from the path, percent-decoded.
    assert console.post(f"/api/runs/{made}/signals/two%20words").json() == {"status": "stored"}
    assert conn.execute("SELECT name, payload FROM runpool.signals ORDER BY id").fetchall() == [
        ("approval", {"approved": True}), ("two words", {})]
    for bad, field in ((f"/api/runs/{made}/signals/{'n' * 201}", "name"),
                       ("/api/runs/not-a-uuid/signals/go", "id")):
        refused = console.post(bad, json={})
        assert refused.status_code == 400 and refused.json()["error"].startswith(field), \
            refused.text
    big = console.post(f"/api/runs/{made}/signals/go", json={"blob": "x" * 1_100_000})
    assert big.status_code == 400 and "payload" in big.json()["error"]
    assert console.post(f"/api/runs/{uuid.uuid4()}/signals/go").status_code == 404
    assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 2
    console.post(f"/api/runs/{made}/cancel")
    assert console.post(f"/api/runs/{made}/signals/go").json() == {"status": "cancelled"}


@pytest.mark.parametrize("tenant_of", [_tenant_from_header, _tenant_async])
def test_web_api_tenant_of__scopes_every_route(dsn: str, conn, tenant_of: Any) -> None:
    other = conn.execute("SELECT runpool.enqueue('globex', 'noop')").fetchone()[0]
    with serving(create_app(dsn, tenant_of=tenant_of)) as url, \
            httpx.Client(base_url=url, headers=JSON, timeout=20) as client:
        acme = {"x-tenant": "acme"}
        # The body's tenant is ignored: the run is acme's.
        made = client.post("/api/runs", json={"tenant": "globex", "handler": "noop"},
                           headers=acme)
        assert made.status_code == 201, made.text
        mine = made.json()["id"]
        assert client.get(f"/api/runs/{mine}", headers=acme).json()["tenant"] == "acme"
        # Another tenant's run is exactly a missing one, on every route.
        assert client.get(f"/api/runs/{other}", headers=acme).status_code == 404
        assert client.post(f"/api/runs/{other}/cancel", headers=acme).status_code == 404
        assert client.post(f"/api/runs/{other}/retry", headers=acme).status_code == 404
        assert client.post(f"/api/runs/{other}/signals/go", headers=acme).status_code == 404
        assert scalar(conn, "SELECT count(*) FROM runpool.signals") == 0
        assert client.get(f"/api/runs/{mine}", headers={"x-tenant": "globex"}
                          ).status_code == 404
        assert status_of(conn, other) == "queued"
        # No tenant: 401 everywhere, nothing written.
        assert client.post("/api/runs", json={"tenant": "acme", "handler": "noop"}
                           ).status_code == 401
        assert client.get(f"/api/runs/{mine}").status_code == 401
        assert _runs(conn) == 2
        # The console and /metrics are not served; /healthz is.
        for path in ("/", "/runs", f"/runs/{mine}", "/dead", "/workers", "/schedules",
                     "/metrics", "/static/console.js"):
            assert client.get(path, headers=acme).status_code == 404, path
        assert client.get("/healthz").status_code == 200
        assert client.post(f"/api/runs/{mine}/cancel", headers=acme).json() == {
            "status": "cancelled"}


def test_web_app_mounted_in_a_service__api_and_console_under_their_prefixes(dsn: str, conn
                                                                             ) -> None:
    """A product mounts the API (Starlette runs no lifespan of a mounted app: the pool opens
    at the first request); the console mounted under a prefix links within it."""
    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Mount, Route

    async def home(request: Request) -> PlainTextResponse:
        return PlainTextResponse("product")

    service = Starlette(routes=[
        Route("/", home),
        Mount("/runs-api", create_app(dsn, tenant_of=_tenant_from_header)),
        Mount("/ops", create_app(dsn)),
    ])
    with serving(service) as url, httpx.Client(base_url=url, headers=JSON,
                                               timeout=20) as client:
        assert client.get("/").text == "product"
        made = client.post("/runs-api/api/runs", json={"handler": "noop"},
                           headers={"x-tenant": "acme"})
        assert made.status_code == 201, made.text
        run_id = made.json()["id"]
        assert client.get(f"/runs-api/api/runs/{run_id}", headers={"x-tenant": "acme"}
                          ).json()["tenant"] == "acme"
        assert client.get("/runs-api/").status_code == 404  # no console in tenant mode
        assert client.get(f"/runs-api/api/runs/{uuid.uuid4()}", headers={"x-tenant": "acme"}
                          ).json() == {"error": "no such run"}
        assert client.get(f"/runs-api/api/runs/{run_id}").json() == {
            "error": "not authenticated"}
        console = client.get("/ops/").text
        assert 'href="/ops/runs"' in console and 'src="/ops/static/console.js"' in console
        assert 'data-tenant="acme"' in console
        assert client.get("/ops/static/console.js").status_code == 200
        run_page = client.get(f"/ops/runs/{run_id}").text
        assert 'data-root="/ops"' in run_page and 'class="here"' not in run_page
        assert _runs(conn) == 1


def test_web_api_a_run_locked_by_an_open_transaction__503_and_the_rest_keeps_working(
        dsn: str, conn, monkeypatch: pytest.MonkeyPatch) -> None:
    from runpool.web import app as web_app

    monkeypatch.setattr(web_app, "STATEMENT_TIMEOUT", "1s")
    locked = conn.execute("SELECT runpool.enqueue('acme', 'noop')").fetchone()[0]
    free = conn.execute("SELECT runpool.enqueue('acme', 'noop')").fetchone()[0]
    with serving(create_app(dsn)) as url, \
            httpx.Client(base_url=url, headers=JSON, timeout=20) as client, \
            psycopg.connect(dsn) as holder:
        holder.execute("SELECT 1 FROM runpool.runs WHERE id = %s FOR UPDATE", (locked,))
        answer = client.post(f"/api/runs/{locked}/cancel")
        assert answer.status_code == 503 and "locked" in answer.json()["error"]
        # Reads never wait for the lock; other runs are untouched by it.
        assert client.get(f"/api/runs/{locked}").json()["status"] == "queued"
        assert 'data-tenant="acme"' in client.get("/").text
        assert client.post(f"/api/runs/{free}/cancel").json() == {"status": "cancelled"}
        holder.rollback()
        assert client.post(f"/api/runs/{locked}/cancel").json() == {"status": "cancelled"}


def test_web_console_hostile_names__escaped_everywhere(console: httpx.Client, conn) -> None:
    evil = '<img src=x onerror="alert(1)">'
    run_id = console.post("/api/runs", json={"tenant": evil, "handler": evil,
                                             "input": {"html": evil}}).json()["id"]
    for path in ("/", f"/runs/{run_id}", "/dead?tenant=" + evil):
        page = console.get(path)
        assert page.status_code == 200
        assert "<img" not in page.text and "&lt;img src=x onerror=" in page.text, path


def test_cli_ui__serves_on_loopback_and_answers_only_loopback_host_names(dsn: str) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys

    from tests.helpers import ROOT, pool_env, wait_for

    with socket.socket() as probe:  # a free port (the server binds it a moment later)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "runpool", "ui", "--port", str(port)],
                            env=pool_env(dsn), cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(url + "/healthz", timeout=2).text == "ok"
            except httpx.TransportError:
                return False

        wait_for(up, timeout=30, what="python -m runpool ui to serve")
        assert httpx.get(f"http://localhost:{port}/").status_code == 200
        # DNS rebinding: a page of another name pointed at 127.0.0.1 gets nothing.
        rebound = httpx.get(url + "/", headers={"host": f"evil.example:{port}"})
        assert rebound.status_code == 400
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=15)
    assert f"console on http://127.0.0.1:{port}/" in err


def test_web_app_without_its_database__503_not_500() -> None:
    """Mounted (no lifespan), its pool opens at the first request: with the database away,
    every route answers 503, and /healthz says so too."""
    from starlette.applications import Starlette
    from starlette.routing import Mount

    with socket_closed_port() as port:
        dsn = f"postgresql://postgres@127.0.0.1:{port}/postgres?connect_timeout=2"
        service = Starlette(routes=[Mount("/runs", create_app(dsn))])
        with serving(service) as url, httpx.Client(base_url=url, headers=JSON,
                                                   timeout=30) as client:
            assert client.get("/runs/healthz").status_code == 503
            answer = client.post("/runs/api/runs", json={"tenant": "a", "handler": "noop"})
            assert answer.status_code == 503
            assert answer.json() == {"error": "the database is unavailable"}


@contextmanager
def socket_closed_port() -> Iterator[int]:
    """A loopback port nothing listens on."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]  # bound, not listening: connections are refused
