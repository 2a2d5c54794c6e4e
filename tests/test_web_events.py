"""GET /api/runs/{id}/events (runpool.follow over Server-Sent Events) through a real uvicorn
server, a real pool and a real database: the whole story, resume with Last-Event-ID, a client
that disconnects mid-stream, tenant scoping, bad input, the per-tenant cap."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from runpool.web import create_app, events
from tests.helpers import running_pool, scalar, status_of, wait_for
from tests.webserver import serving


def _sse(response: httpx.Response) -> Iterator[dict[str, Any]]:
    """The events of an SSE response as they arrive: {"id", "event", "data"}."""
    fields: dict[str, Any] = {}
    for line in response.iter_lines():
        if not line:
            if "data" in fields:
                yield {**fields, "data": json.loads(fields["data"])}
            fields = {}
        elif not line.startswith(":"):
            name, _, value = line.partition(":")
            fields[name] = value.removeprefix(" ")


def _story(client: httpx.Client, run_id: Any, **headers: str) -> list[dict[str, Any]]:
    with client.stream("GET", f"/api/runs/{run_id}/events", headers=headers) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return list(_sse(response))


def _enqueue(conn: Any, tenant: str, handler: str, input: str = "{}") -> uuid.UUID:
    run_id: uuid.UUID = scalar(conn, "SELECT runpool.enqueue(%s, %s, %s)", tenant, handler, input)
    return run_id


def _followers(app: Any) -> int:
    """The app's streams following a run now (none before the first: no hub yet)."""
    hub = app.state.web.hub
    return 0 if hub is None else int(hub.followers)


def test_sse__the_whole_story_then_resume_exactly_after_any_event(dsn: str, conn) -> None:
    run_id = _enqueue(conn, "acme", "chat", '{"turns": 6, "every": 0.05}')
    with running_pool(dsn, app="tests.web_apps:app"), serving(create_app(dsn)) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        story = _story(client, run_id)
        # One SSE event per RunEvent: id = seq, event = kind, data = the whole event.
        seqs = [int(e["id"]) for e in story]
        assert seqs == sorted(set(seqs)) and seqs[0] == 1, seqs
        for e in story:
            assert e["event"] == e["data"]["kind"] and int(e["id"]) == e["data"]["seq"]
            assert set(e["data"]) == {"seq", "kind", "data", "at"}
        kinds = [e["event"] for e in story if e["event"] != "progress"]
        said = [e["data"]["data"]["content"] for e in story if e["event"] == "message"
                and e["data"]["data"]["role"] == "assistant"]
        assert said == [f"turn {i}: still thinking" for i in range(6)]
        assert kinds.count("tool_call") == 4  # two calls, each started then committed
        assert story[0]["data"]["data"]["status"] == "queued"
        assert story[-1]["event"] == "status"
        assert story[-1]["data"]["data"]["status"] == "succeeded"
        assert status_of(conn, run_id) == "succeeded"
        stored = [e for e in story if e["event"] != "progress"]

        # A reconnect gets exactly the rest, whichever event it stopped after.
        for cut in (1, len(stored) // 2, len(stored) - 2):
            rest = _story(client, run_id, **{"Last-Event-ID": stored[cut - 1]["id"]})
            assert [e["id"] for e in rest] == [e["id"] for e in stored[cut:]]
        by_query = client.get(f"/api/runs/{run_id}/events?after={stored[-2]['id']}")
        assert by_query.text.count("event: status") == 1
        # Nothing more will come: 204 tells an EventSource to stop reconnecting.
        done = client.get(f"/api/runs/{run_id}/events",
                          headers={"Last-Event-ID": stored[-1]["id"]})
        assert done.status_code == 204


def test_sse__a_client_gone_mid_stream_frees_its_follower_and_resumes(dsn: str, conn
                                                                       ) -> None:
    run_id = _enqueue(conn, "acme", "chat", '{"turns": 40, "every": 0.1}')
    app = create_app(dsn)
    with running_pool(dsn, app="tests.web_apps:app"), serving(app) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        seen: list[dict[str, Any]] = []
        with client.stream("GET", f"/api/runs/{run_id}/events") as response:
            for event in _sse(response):
                seen.append(event)
                if sum(e["event"] == "message" for e in seen) == 3:
                    assert _followers(app) == 1
                    break  # the client goes away mid-stream
        wait_for(lambda: _followers(app) == 0, what="the stream's follower to stop")
        wait_for(lambda: app.state.web.streams == {}, what="the stream slot back")
        assert status_of(conn, run_id) == "running"  # the run never waited for its follower
        last = [e for e in seen if e["event"] != "progress"][-1]["id"]
        rest = _story(client, run_id, **{"Last-Event-ID": last})
        whole = _story(client, run_id)
        stored = [e["id"] for e in seen + rest if e["event"] != "progress"]
        assert stored == [e["id"] for e in whole if e["event"] != "progress"]
        assert whole[-1]["data"]["data"]["status"] == "succeeded"
        # A finished stream's follower stops once its response has gone out, which may be just
        # after the client read the last byte.
        wait_for(lambda: _followers(app) == 0, what="the finished streams' followers to stop")


def _tenant(request: Request) -> str | None:
    return request.headers.get("x-tenant")


def test_sse__tenant_scope_bad_input_and_the_per_tenant_cap(
        dsn: str, conn, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(events, "MAX_STREAMS_PER_TENANT", 2)
    mine = _enqueue(conn, "acme", "nobody_serves_this")
    other = _enqueue(conn, "globex", "nobody_serves_this")
    acme = {"x-tenant": "acme"}
    app = create_app(dsn, tenant_of=_tenant)
    with serving(app) as url, \
            httpx.Client(base_url=url, timeout=30) as client:
        assert client.get(f"/api/runs/{mine}/events").status_code == 401
        assert client.get(f"/api/runs/{other}/events", headers=acme).status_code == 404
        assert client.get(f"/api/runs/{uuid.uuid4()}/events", headers=acme).status_code == 404
        for bad in ("-1", "x", "1.5", str(2**63)):
            answer = client.get(f"/api/runs/{mine}/events",
                                headers={**acme, "Last-Event-ID": bad})
            assert answer.status_code == 400 and "Last-Event-ID" in answer.json()["error"]
        answer = client.get(f"/api/runs/{mine}/events?after=nope", headers=acme)
        assert answer.status_code == 400 and "after" in answer.json()["error"]
        assert _followers(app) == 0

        # A queued run's stream stays open (its 'queued' event first); two per tenant.
        with client.stream("GET", f"/api/runs/{mine}/events", headers=acme) as first, \
                client.stream("GET", f"/api/runs/{mine}/events", headers=acme) as second:
            # Held in a list: an iterator of a response dropped early closes its connection.
            readers = [_sse(first), _sse(second)]
            for reader in readers:
                assert next(reader)["data"]["data"]["status"] == "queued"
            third = client.get(f"/api/runs/{mine}/events", headers=acme, timeout=10)
            assert third.status_code == 429
            assert _followers(app) == 2
            # Another tenant is not held back by acme's streams.
            with client.stream("GET", f"/api/runs/{other}/events?after=1",
                               headers={"x-tenant": "globex"}) as globex:
                assert globex.status_code == 200
                assert next(globex.iter_lines()) == "retry: 2000"
        wait_for(lambda: _followers(app) == 0, what="the streams' followers to stop")
