"""The worker's hot path costs what it should: every statement fits psycopg's query cache (a
longer one is parsed anew on each execution), finish_runs' parameters, built as array
literals, store every outcome exactly as the list dumper did, and a run leaves no garbage for
the cyclic GC, and a claimed run is built from its row by position."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import uuid
from typing import Any

import psycopg
from psycopg import _queries

import runpool
from runpool.claiming import ClaimedRun, claim
from runpool.codec import dumps
from runpool.context import Run
from runpool.db import aconnect
from runpool.outcomes import Outcome, finish_params, retry_after
from runpool.queries import QUERIES


def test_statements__each_fits_psycopg_query_cache() -> None:
    # Over the limit, psycopg converts the query by a regular expression on every execution:
    # ~50 us per statement per batch (claim_runs and finish_runs were, with their comments).
    over = {name: len(q) for name, q in QUERIES.items()
            if len(q) > _queries.MAX_CACHED_STATEMENT_LENGTH}
    assert over == {}


def test_statements__keep_their_first_line_only_of_their_comments() -> None:
    # pg_stat_activity shows an operator the purpose; the bloat bench finds the claim by it.
    assert QUERIES["claim_runs"].startswith("-- Claim up to %(limit)s runs")
    assert all("\n--" not in q and "\n    --" not in q for q in QUERIES.values())


# Values whose JSON text an array literal must quote and escape.
AWKWARD: list[Any] = [
    {"a": 'q"uo\\te', "u": "ünï\u2028 {x,y} NULL", "n": [1, 2.5, None]}, "NULL", None, 'x"',
    "\\", {"": "}"}, "", [], {"nested": {"\\\"": ["{", "}", ","]}}]


async def _claim(dsn: str, n: int) -> list[tuple[uuid.UUID, int]]:
    async with await aconnect(dsn, autocommit=True) as c:
        claimed = await claim(c, limit=n, worker_id=uuid.uuid4(), lease_seconds=30,
                              handlers=["noop"])
    return [(r.id, r.attempt) for r in claimed]


def test_finish_params__store_awkward_results_and_errors_exactly(
        conn: psycopg.Connection, dsn: str) -> None:
    for _ in range(len(AWKWARD) + 1):
        runpool.enqueue(conn, "acme", "noop")
    runs = asyncio.run(_claim(dsn, len(AWKWARD) + 1))
    outcomes = [Outcome(run_id, attempt, "succeeded", result=dumps(value))
                for (run_id, attempt), value in zip(runs, AWKWARD, strict=False)]
    last_id, last_attempt = runs[-1]
    outcomes.append(retry_after(last_id, last_attempt, 1, 60.0,
                                dumps({"reason": "exception", "message": 'say "\\n"'})))
    statuses: dict[uuid.UUID, str] = {run_id: status for run_id, _, status in conn.execute(
        QUERIES["finish_runs"], finish_params(outcomes)).fetchall()}
    assert statuses == {**{r: "succeeded" for r, _ in runs[:-1]}, last_id: "queued"}
    stored: dict[uuid.UUID, Any] = dict(conn.execute(
        "SELECT id, result FROM runpool.runs WHERE status = 'succeeded'").fetchall())
    assert [stored[r] for r, _ in runs[:-1]] == AWKWARD
    error, delay = conn.execute(
        "SELECT error, extract(epoch FROM available_at - now()) FROM runpool.runs"
        " WHERE id = %s", (last_id,)).fetchone() or (None, None)
    assert error == {"reason": "exception", "message": 'say "\\n"'}
    assert 60 * 0.75 - 15 < float(delay) <= 60 * 1.25  # its backoff, jittered


def test_run__a_finished_attempt_leaves_no_reference_cycle() -> None:
    # A cycle through the Run (its Waits referred back to it) kept ~15 objects per run for
    # the cyclic GC; freed by reference counting, they never reach it.
    async def attempt() -> int:
        gc.collect()
        run = Run(id=uuid.uuid4(), tenant="acme", handler="noop", attempt=1, input={"a": 1})
        assert not run.cancelled
        del run
        return gc.collect()

    assert asyncio.run(attempt()) == 0


def test_claim_runs__answers_in_claimed_runs_field_order(conn: psycopg.Connection) -> None:
    # read_claimed builds a ClaimedRun from each row by position: the statement's columns are
    # its fields, in order (a column added to one must be added to the other, in place).
    cur = conn.execute(QUERIES["claim_runs"], {
        "limit": 1, "worker_id": uuid.uuid4(), "lease_seconds": 30, "handlers": ["noop"]})
    assert cur.description is not None
    assert [d.name for d in cur.description] == [f.name for f in dataclasses.fields(ClaimedRun)]
