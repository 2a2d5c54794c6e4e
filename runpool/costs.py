"""What a run spends: its usage totals (committed, fenced), the budget rule that stops it, and
the shared rate limits it waits for. The Run (runpool.context) calls these; the SQL is here."""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from .codec import loads
from .db import translate_error
from .deadlines import bounded
from .errors import BudgetExceeded, InvalidInput, LeaseLost
from .limits import check_name
from .tasks import finish_anyway

__all__ = ["LIMITS", "Usage", "acquire", "check", "decode", "recorder"]

logger = logging.getLogger("runpool.costs")

# Each budget limit and the usage total it bounds (migration 0012's check_budget accepts these
# keys and no others).
LIMITS: Final = (("max_tokens", "tokens"), ("max_cost", "cost"),
                 ("max_tool_calls", "tool_calls"), ("max_turns", "turns"))

# Add one model call's usage to the run's totals, if this attempt holds the run (the fence);
# a write repeated after a lost acknowledgement (its usage_write already stored) adds nothing.
# tool_calls and turns are counted by the Run from its committed history: stored as of now.
RECORD_USAGE: Final = """
UPDATE runpool.runs r SET
    usage = jsonb_build_object(
        'input_tokens', coalesce((r.usage ->> 'input_tokens')::bigint, 0) + %(input_tokens)s,
        'output_tokens', coalesce((r.usage ->> 'output_tokens')::bigint, 0) + %(output_tokens)s,
        'cost', coalesce((r.usage ->> 'cost')::numeric, 0) + %(cost)s::numeric,
        'tool_calls', greatest(coalesce((r.usage ->> 'tool_calls')::bigint, 0), %(tool_calls)s),
        'turns', greatest(coalesce((r.usage ->> 'turns')::bigint, 0), %(turns)s)),
    usage_write = %(write)s
-- (Running, said as a worker's statements say it: see queries.sql.)
WHERE r.id = %(run_id)s AND r.attempt = %(attempt)s AND r.lease_expires_at IS NOT NULL
  AND r.usage_write IS DISTINCT FROM %(write)s
RETURNING r.usage::text
"""
# The totals after this attempt's own earlier write `write` (a repeat reads them back).
USAGE_WRITTEN: Final = """
SELECT r.usage::text FROM runpool.runs r
WHERE r.id = %(run_id)s AND r.attempt = %(attempt)s AND r.lease_expires_at IS NOT NULL
  AND r.usage_write = %(write)s
"""
# Reserve units of a rate limit: the seconds to wait before using them, and the reservation's
# token for release_rate (see 0012).
ACQUIRE: Final = "SELECT wait, reserved_until FROM runpool.acquire_rate(%(key)s, %(units)s)"
# Give a reservation back, if no later one was planned after it.
RELEASE: Final = "SELECT runpool.release_rate(%(key)s, %(units)s, %(until)s)"

# How often a waiting acquire looks whether its run was stopped (a plain handler's wait runs
# on the loop, outside the task the worker cancels).
STOP_POLL_SECONDS: Final = 0.25


@dataclass(frozen=True, slots=True)
class Usage:
    """A run's totals across its attempts."""

    input_tokens: int = 0
    output_tokens: int = 0
    cost: float = 0.0
    tool_calls: int = 0
    turns: int = 0

    @property
    def tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def decode(data: bytes | str | None) -> dict[str, Any]:
    """A jsonb object column (budget, usage) as a dict; {} for NULL."""
    return {} if data is None else dict(loads(data))


def check(budget: Mapping[str, Any], usage: Usage) -> None:
    """The budget rule: BudgetExceeded once a total is greater than its maximum."""
    for limit, total in LIMITS:
        maximum = budget.get(limit)
        value = getattr(usage, total)
        if maximum is not None and value > maximum:
            raise BudgetExceeded(limit, float(maximum), float(value))


def _count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**53:
        raise InvalidInput(f"record_usage: {name} must be a whole number >= 0, got {value!r}")


def recorder(*, run_id: uuid.UUID, attempt: int, write: str, input_tokens: int,
             output_tokens: int, cost: float, tool_calls: int, turns: int
             ) -> Callable[[psycopg.AsyncConnection[Any], int], Awaitable[dict[str, Any]]]:
    """The write adding a model call's usage to the run's totals (one fenced statement, safe
    to repeat: `write` names it within the attempt); it returns the new totals. InvalidInput
    for a value that is not a count or a cost, before anything is written."""
    _count("input_tokens", input_tokens)
    _count("output_tokens", output_tokens)
    if isinstance(cost, bool) or not isinstance(cost, int | float) or not math.isfinite(cost) \
            or not 0 <= cost < 1e15:
        raise InvalidInput(f"record_usage: cost must be a finite number >= 0, got {cost!r}")
    params = {"run_id": run_id, "attempt": attempt, "write": write,
              "input_tokens": input_tokens, "output_tokens": output_tokens, "cost": cost,
              "tool_calls": tool_calls, "turns": turns}

    async def op(conn: psycopg.AsyncConnection[Any], tries: int) -> dict[str, Any]:
        cur = await conn.execute(RECORD_USAGE, params)
        row = await cur.fetchone()
        if row is None:
            cur = await conn.execute(USAGE_WRITTEN, params)
            row = await cur.fetchone()
        if row is None:
            raise LeaseLost(f"attempt {attempt} of run {run_id} no longer holds its lease")
        return decode(row[0])

    return op


def _key(key: Any, units: Any) -> None:
    check_name(key, "acquire: key")
    if isinstance(units, bool) or not isinstance(units, int | float) \
            or not math.isfinite(units) or units <= 0:
        raise InvalidInput(f"acquire: units must be a finite number > 0, got {units!r}")


async def acquire(pool: AsyncConnectionPool, seconds: float, key: str, units: float,
                  stopped: Callable[[], str | None]) -> float:
    """Take `units` of rate limit `key`: one short statement reserves them (in arrival order,
    across every host), then the caller sleeps exactly until they are its own, holding no
    transaction. `stopped()` names why the run stopped (cancelled, timed out, lease lost),
    which ends the wait with CancelledError. Returns the seconds the reservation said to
    wait."""
    _key(key, units)
    why = stopped()
    if why:
        raise asyncio.CancelledError(why)
    try:
        async with bounded(pool, seconds) as conn:
            cur = await conn.execute(ACQUIRE, {"key": key, "units": float(units)})
            row = await cur.fetchone()
    except psycopg.Error as exc:
        raise translate_error(exc) from exc
    assert row is not None
    wait, until = float(row[0]), row[1]
    end = time.monotonic() + wait
    try:
        while (left := end - time.monotonic()) > 0:
            await asyncio.sleep(min(left, STOP_POLL_SECONDS))
            why = stopped()
            if why:
                raise asyncio.CancelledError(why)
    except BaseException:
        # Stopped while waiting: the units go back if no later reservation was planned after
        # them (best effort: on failure they are simply not used).
        await finish_anyway(_release(pool, key, float(units), until))
        raise
    return wait


async def _release(pool: AsyncConnectionPool, key: str, units: float, until: Any) -> None:
    try:
        async with bounded(pool, 2.0) as conn:
            await conn.execute(RELEASE, {"key": key, "units": units, "until": until})
    except Exception as exc:  # the reservation lapses unused: safe, only wasteful
        logger.info("rate limit %r: units not given back: %r", key, exc,
                    extra={"action": "rate_release_failed"})


Write = Callable[[Callable[[psycopg.AsyncConnection[Any], int], Awaitable[dict[str, Any]]]],
                 Awaitable[dict[str, Any]]]


class Meter:
    """One attempt's view of its run's spending: the budget, the tokens and cost stored on the
    run (across attempts) and the turns counted from the committed history; the Run passes its
    tool call count (its committed and in-flight calls)."""

    def __init__(self, budget: Mapping[str, Any] | None, usage: Mapping[str, Any] | None,
                 turns: int) -> None:
        self.budget = dict(budget or {})
        stored = dict(usage or {})
        self._tokens_in = int(stored.get("input_tokens", 0))
        self._tokens_out = int(stored.get("output_tokens", 0))
        self._cost = float(stored.get("cost", 0.0))
        self._turns = turns
        self._writes = 0
        # One usage write at a time: a repeated write is told apart by its name alone.
        self._lock = asyncio.Lock()

    def totals(self, calls: int, *, more_calls: int = 0, more_turns: int = 0) -> Usage:
        return Usage(self._tokens_in, self._tokens_out, self._cost, calls + more_calls,
                     self._turns + more_turns)

    def check(self, calls: int, *, more_calls: int = 0, more_turns: int = 0) -> None:
        """BudgetExceeded if the totals, with what is about to be added, are over budget."""
        if self.budget:
            check(self.budget, self.totals(calls, more_calls=more_calls, more_turns=more_turns))

    def turned(self) -> None:
        self._turns += 1

    async def record(self, write: Write, *, run_id: uuid.UUID, attempt: int, calls: int,
                     input_tokens: int, output_tokens: int, cost: float) -> Usage:
        """Commit a model call's usage through `write` (the Run's fenced, retried writes);
        returns the new totals."""
        async with self._lock:
            self._writes += 1
            stored = await write(recorder(
                run_id=run_id, attempt=attempt, write=f"{attempt}:{self._writes}",
                input_tokens=input_tokens, output_tokens=output_tokens, cost=cost,
                tool_calls=calls, turns=self._turns))
        self._tokens_in = int(stored["input_tokens"])
        self._tokens_out = int(stored["output_tokens"])
        self._cost = float(stored["cost"])
        return self.totals(calls)
