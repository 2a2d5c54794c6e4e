"""Attack 2 on the HTTP run API and the enqueue it reaches: a hostile tenant's numbers, times
and headers, through a real uvicorn on a real database. Each must be a 400 naming the field,
nothing written, never a 500 (which also drops the client's keep-alive connection)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import httpx
import psycopg
import pytest
from starlette.requests import Request

import runpool
from runpool.enqueue import RunSpec, enqueue_many
from runpool.web import create_app, events
from tests.helpers import scalar, wait_for
from tests.webserver import serving

ACME = {"x-tenant": "acme", "content-type": "application/json"}


def _tenant(request: Request) -> str | None:
    return request.headers.get("x-tenant")


@pytest.fixture
def api(dsn: str) -> Iterator[httpx.Client]:
    """The tenant-scoped app (tenant from a header), served."""
    with serving(create_app(dsn, tenant_of=_tenant)) as url, \
            httpx.Client(base_url=url, headers=ACME, timeout=20) as client:
        yield client


def _runs(conn: psycopg.Connection[Any]) -> int:
    return int(scalar(conn, "SELECT count(*) FROM runpool.runs"))


@pytest.mark.parametrize(("body", "field"), [
    # Integers beyond PostgreSQL's integer: psycopg sends them as bigint, and no enqueue
    # takes a bigint (UndefinedFunction, a 500, before the fix).
    ({"handler": "noop", "priority": 2**63 - 1}, "priority"),
    ({"handler": "noop", "priority": -2**63}, "priority"),
    ({"handler": "noop", "priority": 2**31}, "priority"),
    ({"handler": "noop", "max_attempts": 2**40}, "max_attempts"),
    # A deadline the database stores but no Python client can read back (year 10000 in
    # UTC): one tenant's run would fail every psycopg read of the runs around it.
    ({"handler": "noop", "deadline": "9999-12-31T23:59:59-14:00"}, "deadline"),
    ({"handler": "noop", "deadline": "9000-01-01T00:00:00Z"}, "deadline"),
    # ... and one before the year 1 (UTC), which no Python client can read either.
    ({"handler": "noop", "deadline": "0001-01-01T00:00:00+14:00"}, "deadline"),
])
def test_attack2_api__out_of_range_numbers_and_times_are_400_naming_the_field(
        api: httpx.Client, conn, body: dict[str, Any], field: str) -> None:
    answer = api.post("/api/runs", json=body)
    assert answer.status_code == 400, answer.text
    assert field in answer.json()["error"], answer.json()
    assert _runs(conn) == 0
    # The connection is still served (a 500 closes it).
    assert api.get("/healthz").status_code == 200


def test_attack2_enqueue__out_of_range_integers_are_invalid_input(conn) -> None:
    for kwargs in ({"priority": 2**40}, {"max_attempts": -2**40}, {"priority": 2.0}):
        with pytest.raises(runpool.InvalidInput, match=next(iter(kwargs))):
            runpool.enqueue(conn, "acme", "noop", {}, **kwargs)
        with pytest.raises(runpool.InvalidInput, match=next(iter(kwargs))):
            enqueue_many(conn, [RunSpec("acme", "noop", {}, **kwargs)])
    with pytest.raises(runpool.InvalidInput, match="deadline"):
        runpool.enqueue(conn, "acme", "noop", {},
                        deadline=datetime(9999, 1, 1, tzinfo=UTC))
    assert _runs(conn) == 0
    # A deadline within reach, and a past one (it ends deadline_exceeded), are taken.
    runpool.enqueue(conn, "acme", "noop", {}, deadline=datetime(2030, 1, 1, tzinfo=UTC))
    runpool.enqueue(conn, "acme", "noop", {}, deadline=datetime(2000, 1, 1, tzinfo=UTC))
    assert _runs(conn) == 2


@pytest.mark.parametrize("seq", ["\u00b2", "1\u00b9", "\u0661", "\uff11"])
def test_attack2_sse__a_seq_in_other_digits_is_400_not_500(api: httpx.Client, conn,
                                                           seq: str) -> None:
    """'²' is a digit to str.isdigit but not to int(): a 500 before the fix; '١' and '１'
    were taken as seq 1 (the stream opened)."""
    run_id = scalar(conn, "SELECT runpool.enqueue('acme', 'nobody_serves_this')")
    header = seq.encode("latin-1") if seq.isascii() or ord(max(seq)) < 256 else seq.encode()
    answer = api.get(f"/api/runs/{run_id}/events", headers={b"Last-Event-ID": header},
                     timeout=5)
    assert answer.status_code == 400, answer.text
    assert "Last-Event-ID" in answer.json()["error"]
    answer = api.get(f"/api/runs/{run_id}/events", params={"after": seq}, timeout=5)
    assert answer.status_code == 400, answer.text
    assert "after" in answer.json()["error"]
    assert api.get(f"/api/runs/{uuid.uuid4()}").status_code == 404  # still served


def test_attack2_sse__the_apps_streams_take_no_connection_each_and_are_capped(
        dsn: str, conn, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each stream held a connection of its own: the app's cap of 200 was over PostgreSQL's
    default max_connections (100), so five tenants' 20 streams each took every connection the
    pools and the API needed, and a cap of a quarter of the server's connections allowed 25
    streams. The streams now share one hub (one LISTEN connection, a few readers): 40 streams
    open at once hold no more connections than one, and the app's cap still answers 503."""
    run_id = scalar(conn, "SELECT runpool.enqueue('acme', 'nobody_serves_this')")
    path = f"/api/runs/{run_id}/events"
    app = create_app(dsn)

    def hub_connections() -> int:
        return int(scalar(conn, "SELECT count(*) FROM pg_stat_activity WHERE"
                                " application_name LIKE %s AND datname = current_database()",
                          events.APPLICATION_NAME + "%"))

    with serving(app) as url, contextlib.ExitStack() as streams, \
            httpx.Client(base_url=url, timeout=20,
                         limits=httpx.Limits(max_connections=60)) as client:
        for _ in range(40):
            response = streams.enter_context(client.stream("GET", path))
            assert response.status_code == 200
        wait_for(lambda: app.state.web.hub.followers == 40, what="40 followers")
        assert hub_connections() <= 1 + 4  # its LISTEN connection and its readers
        monkeypatch.setattr(events, "MAX_STREAMS", 40)
        refused = client.get(path, timeout=5)
        assert refused.status_code == 503, refused.text
        assert "too many event streams" in refused.json()["error"]
    wait_for(lambda: app.state.web.streams == {}, what="the stream slots back")


def test_attack2_sse__closed_streams_leave_no_count_behind(dsn: str, conn) -> None:
    """The per-tenant counts kept an entry for every tenant that ever opened a stream: with a
    tenant_of that trusts what the client sends, a client naming a new tenant per request
    grew them without bound (and summed them all at every stream's start)."""
    app = create_app(dsn, tenant_of=_tenant)
    with serving(app) as url, httpx.Client(base_url=url, timeout=20) as client:
        for n in range(5):
            tenant = f"tenant-{n}"
            run_id = scalar(conn, "SELECT runpool.enqueue(%s, 'noop')", tenant)
            conn.execute("SELECT runpool.cancel_run(%s)", (run_id,))
            answer = client.get(f"/api/runs/{run_id}/events", headers={"x-tenant": tenant})
            assert answer.status_code == 200 and b"cancelled" in answer.content
        # A stream gives its slot back after its last byte went out.
        wait_for(lambda: app.state.web.streams == {}, timeout=10, what="the counts to go")
