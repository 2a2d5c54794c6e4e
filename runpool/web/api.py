"""The run API (JSON): create, read, cancel, retry and signal a run, each confined to the
request's tenant when the app has a tenant_of.

Bad input is a 400 whose message names the field, and nothing is written. POST bodies must
be sent as `Content-Type: application/json`: a browser sends that type cross-site only after
a CORS preflight, which this app never grants, so another site's page cannot make a
logged-in operator's browser cancel or retry runs.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Final

import orjson
import psycopg
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from runpool.codec import dumps, jsonb
from runpool.db import translate_error
from runpool.enqueue import enqueue_async
from runpool.errors import InvalidInput
from runpool.limits import check_name

from .state import jsonable, parse_run_id, web_of

__all__ = ["MAX_BODY_BYTES", "cancel_run", "create_run", "read_json", "read_run", "retry_run",
           "signal_run"]

# Largest request body read: above the database's own input limit (1 MiB by default), which
# enqueue enforces with a clear message; this one only keeps a request from filling memory.
MAX_BODY_BYTES: Final = 8 * 1024 * 1024

# POST /api/runs body fields, with the JSON types each accepts (None: null).
_FIELDS: Final[dict[str, tuple[type, ...]]] = {
    "tenant": (str,),
    "handler": (str,),
    "input": (object,),
    "priority": (int,),
    "idempotency_key": (str, type(None)),
    "serial_key": (str, type(None)),
    "run_at": (str, type(None)),
    "max_attempts": (int, type(None)),
    "traceparent": (str, type(None)),
    # Cost control: seconds one attempt may run, when the run must end (ISO 8601 with a time
    # zone), and its budget object (enqueue validates the values).
    "timeout": (int, float, type(None)),
    "deadline": (str, type(None)),
    "budget": (dict, type(None)),
}
_TYPE_NAMES: Final = {str: "a string", int: "an integer", float: "a number",
                      dict: "an object", type(None): "null", object: "JSON"}

# The run columns GET /api/runs/{id} answers with.
RUN_KEYS: Final = (
    "id", "tenant", "handler", "status", "priority", "attempt", "max_attempts", "input",
    "result", "error", "usage", "budget", "deadline", "idempotency_key", "serial_key",
    "cancel_reason",
    "created_at", "started_at", "finished_at", "lease_expires_at", "cancel_requested_at",
)


async def read_json(request: Request) -> Any:
    """The request's JSON body (None when empty), bounded by MAX_BODY_BYTES."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise HTTPException(415, "send the body as Content-Type: application/json")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise HTTPException(413, f"the body is over {MAX_BODY_BYTES} bytes")
    if not body.strip():
        return None
    try:
        return orjson.loads(bytes(body))
    except orjson.JSONDecodeError as exc:
        raise InvalidInput(f"body: not valid JSON: {exc}") from None


def _object(body: Any) -> dict[str, Any]:
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise InvalidInput("body: must be a JSON object")
    return body


def _check_fields(body: dict[str, Any]) -> None:
    for name, value in body.items():
        kinds = _FIELDS.get(name)
        if kinds is None:
            raise InvalidInput(f"{name}: unknown field (known: {', '.join(_FIELDS)})")
        # bool is an int in Python, never in JSON.
        if (isinstance(value, bool) and object not in kinds) or not isinstance(value, kinds):
            wanted = " or ".join(_TYPE_NAMES[k] for k in kinds)
            raise InvalidInput(f"{name}: must be {wanted}")


def _time(name: str, text: str | None) -> datetime | None:
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"{name}: not an ISO 8601 time: {text[:60]!r}") from None
    if when.tzinfo is None:
        raise InvalidInput(f"{name}: give a time zone (e.g. 2026-12-01T02:30:00Z)")
    return when


async def create_run(request: Request) -> Response:
    """POST /api/runs: enqueue a run; 201 {"id"}. With tenant_of, a body tenant is ignored."""
    web = web_of(request)
    scope = await web.scope(request)
    body = _object(await read_json(request))
    _check_fields(body)
    tenant = scope if scope is not None else body.get("tenant")
    if tenant is None:
        raise InvalidInput("tenant: required")
    if "handler" not in body:
        raise InvalidInput("handler: required")
    options = {k: body[k] for k in ("idempotency_key", "serial_key", "max_attempts",
                                    "traceparent", "timeout", "budget") if k in body}
    async with web.connection() as conn:
        try:
            run_id = await enqueue_async(
                conn, tenant, body["handler"], body.get("input", {}),
                priority=body.get("priority", 0), run_at=_time("run_at", body.get("run_at")),
                deadline=_time("deadline", body.get("deadline")), **options)
        except psycopg.Error as exc:
            raise translate_error(exc) from exc
    return JSONResponse({"id": str(run_id)}, status_code=201)


async def read_run(request: Request) -> Response:
    """GET /api/runs/{id}: the run's state, result, error and times."""
    web = web_of(request)
    scope = await web.scope(request)
    run_id = parse_run_id(request.path_params["id"])
    async with web.connection() as conn:
        rows = await web.rows(conn, "run", {"id": run_id, "tenant": scope})
    if not rows:
        raise HTTPException(404, "no such run")
    run = rows[0]["run"]
    return JSONResponse({k: run[k] for k in RUN_KEYS if k in run}
                        | {"attempts_left": rows[0]["attempts_left"]})


async def _answer(request: Request, query: str, **params: Any) -> Response:
    web = web_of(request)
    scope = await web.scope(request)
    run_id = parse_run_id(request.path_params["id"])
    async with web.connection() as conn:
        try:
            cur = await conn.execute(web.sql[query], {"id": run_id, "tenant": scope, **params})
        except psycopg.Error as exc:
            raise translate_error(exc) from exc
        row = await cur.fetchone()
    if row is None or row[0] is None:
        raise HTTPException(404, "no such run")
    return JSONResponse({"status": jsonable(row[0])})


async def cancel_run(request: Request) -> Response:
    """POST /api/runs/{id}/cancel, body {"reason"?}: cancel_run's answer."""
    body = _object(await read_json(request))
    unknown = set(body) - {"reason"}
    if unknown:
        raise InvalidInput(f"{sorted(unknown)[0]}: unknown field (known: reason)")
    reason = body.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise InvalidInput("reason: must be a string or null")
    return await _answer(request, "cancel", reason=reason)


async def retry_run(request: Request) -> Response:
    """POST /api/runs/{id}/retry: retry_run's answer."""
    _object(await read_json(request))
    return await _answer(request, "retry")


async def signal_run(request: Request) -> Response:
    """POST /api/runs/{id}/signals/{name}, body: the payload (any JSON; an empty body or null
    sends {}): signal_run's answer — 'delivered', 'stored' or the run's terminal status."""
    payload = await read_json(request)
    name = check_name(request.path_params["name"], "name: the signal name")
    return await _answer(request, "signal", name=name,
                         payload=jsonb(dumps({} if payload is None else payload)))
