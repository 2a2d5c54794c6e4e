"""Attack 2 on the HTTP run API and the enqueue it reaches: a hostile tenant's numbers, times
and headers, through a real uvicorn on a real database. Each must be a 400 naming the field,
nothing written, never a 500 (which also drops the client's keep-alive connection)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
from starlette.requests import Request

from runpool.web import create_app
from tests.helpers import scalar
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
