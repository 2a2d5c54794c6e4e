"""An operator's way past a tool call a dead-lettered run cannot get past (SQL
runpool.resolve_tool_call): "it was done, here is its result" or "run it again"."""

from __future__ import annotations

import uuid
from typing import Any, Final

import psycopg
from psycopg import errors as pg_errors

from .codec import dumps, jsonb
from .db import require_utf8, translate_error
from .errors import InvalidInput
from .limits import check_name, check_tenant

__all__ = ["resolve_tool_call"]

# The SQL API, called exactly as an application would.
RESOLVE: Final = """
SELECT runpool.resolve_tool_call(%(run_id)s::uuid, %(call_id)s, %(result)s, %(retry)s,
                                 %(tenant)s)"""

_UNSET: Final[Any] = object()


def resolve_tool_call(conn: psycopg.Connection[Any], run_id: uuid.UUID | str, call_id: str, *,
                      result: Any = _UNSET, retry: bool = False,
                      tenant: str | None = None) -> str | None:
    """Resolve a call of a run that is not running: `result=` records it succeeded with that
    result (the tool message says so), `retry=True` forgets it so the next attempt runs the
    tool again. Returns 'succeeded' or 'retry', or None if there is no such run or call (or
    the run is another tenant's). Then `retry_run` puts a failed run back in the queue."""
    if (result is _UNSET) == (not retry):
        raise InvalidInput("resolve_tool_call: give either result=... or retry=True")
    check_name(call_id, "call_id")
    check_tenant(tenant)
    require_utf8(conn)
    try:
        row = conn.execute(RESOLVE, {
            "run_id": str(run_id), "call_id": call_id, "retry": retry, "tenant": tenant,
            "result": None if result is _UNSET else jsonb(dumps(result))}).fetchone()
    except pg_errors.ObjectNotInPrerequisiteState as exc:
        raise InvalidInput(exc.diag.message_primary or str(exc)) from None
    except psycopg.Error as exc:
        raise translate_error(exc) from None
    return None if row is None else row[0]
