"""One claim cycle: reap expired leases, lock tenants with room, claim their best heads."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeAlias

import psycopg

from . import faults
from .codec import loads_exact
from .db import NO_JIT, one_trip
from .errors import InvalidInput
from .queries import QUERIES
from .trips import JsonText, Rows, Trip, Via

__all__ = ["ClaimedRun", "PendingClaim", "Statements", "claim", "claim_statements",
           "read_claimed", "reap"]

# Where a claim's statements go: a connection's pipelined transaction (db.one_trip), or a
# pinned worker session's trip (runpool.trips).
Statements: TypeAlias = psycopg.AsyncConnection[Any] | Trip


@dataclass(frozen=True, slots=True)
class ClaimedRun:
    id: uuid.UUID
    tenant: str
    handler: str
    attempt: int
    # Of max_attempts (runpool.attempts_used: released attempts and those before a retry_run
    # do not count).
    attempts_used: int
    max_attempts: int
    # The input's JSON text, decoded only in the run's own slot (see decode_input).
    input: bytes
    traceparent: str | None
    created_at: datetime
    serial_key: str | None = None
    # The run's budget and its usage so far (JSON text, decoded in the slot), and the seconds
    # until its attempt's timeout or its deadline, by the database's clock (None: neither).
    budget: bytes | None = None
    usage: bytes | None = None
    due_in: float | None = None
    # Whether the run's previous attempt was reclaimed by the reaper (its lease expired), and
    # the seconds it waited claimable (since its available_at, by the database's clock).
    reclaimed: bool = False
    waited: float = 0.0

    def decode_input(self) -> Any:
        """The run's input as Python values; InvalidInput for a value jsonb holds but the
        decoder refuses (JSON nested deeper than orjson's 1,024 levels, say)."""
        try:
            return loads_exact(self.input)
        except ValueError as exc:
            raise InvalidInput(f"the run's input cannot be decoded: {exc}") from None


@dataclass(frozen=True, slots=True)
class PendingClaim:
    """A claim's statements, sent in the caller's transaction, their answers read only after
    its COMMIT (see read_claimed): reading any before would cost the claim a round trip."""
    claimed: Rows
    # The schedules' probe and whom to tell its answer (None: not probed in this claim).
    probe: Rows | None = None
    on_schedules: Callable[[float | None, bool], None] | None = None
    # The tenant locks' answer and whom to tell whether a quota'd tenant was skipped (its row
    # held by another transaction): None, not asked.
    locks: Rows | None = None
    on_skipped: Callable[[bool], None] | None = None


async def reap(conn: psycopg.AsyncConnection[Any]) -> int:
    """Return expired leases to the queue; returns how many runs were reaped."""
    cur = await conn.execute(QUERIES["reap_expired"])
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def claim_statements(
    conn: Statements,
    *,
    worker_id: uuid.UUID,
    limit: int,
    lease_seconds: float,
    touch: bool = False,
    reap_expired: bool = True,
    promote: bool = True,
    handlers: Sequence[str] | None = None,
    on_schedules: Callable[[float | None, bool], None] | None = None,
    on_skipped: Callable[[bool], None] | None = None,
    roomy: bool = False,
) -> PendingClaim:
    """The claim's statements, run inside the caller's pipelined transaction. Returns the
    pending claim, to be read after COMMIT (read_claimed): a run is handed to a handler only
    once its claim is durable.

    The tenant locks make quotas exact under any number of concurrent claimers; the claim
    statement runs after them so its snapshot already sees every earlier claimer's commit
    (read committed takes a snapshot per statement, and the server runs a pipeline's
    statements in order: the claim's starts once every lock is held). It finds the chosen
    and locked tenants in the transaction's settings, so it is sent right behind the locks
    without waiting for their answer: the whole claim is one round trip.
    With `touch`, the worker's liveness is recorded in the same transaction, so an idle worker
    costs one transaction per poll and no more. `reap_expired` returns expired leases to the
    queue first (a busy worker need not do it on every claim: an expired lease never counts
    against a quota, it only waits to be claimable again) and gives headless serial keys their
    head (see heal_serial_keys). `promote` first lets runs whose time came (a run_at, a retry's
    backoff, a durable sleep) into the claim's index: a busy worker's refills do it at a
    cadence, not on every claim. With `handlers`, only runs of those handlers are claimed (a
    mixed fleet: another pool's runs wait for it). With `on_schedules`, the reap also probes
    the schedules' earliest plan and tells it (seconds until it, whether one needs planning).
    With `on_skipped`, it is told whether the claim passed over a quota'd tenant whose row
    another transaction held (see lock_tenants): that tenant's runs need another claim soon.
    `roomy`: the claimer's own slots are in runpool.quota_margin (a registered worker past
    its fleet fence), so a quota'd tenant far under its quota is claimed without its lock.
    """
    probe = None
    if reap_expired:
        await conn.execute(QUERIES["reap_expired"])
        # Queued runs past their deadline end here, with no worker involved (an index probe
        # when none has a deadline).
        await conn.execute(QUERIES["expire_deadlines"])
        # The heal sweep rides here, at the reap's cadence, rather than in a transaction of
        # its own: an idle pool costs one transaction per poll and no more (W3). It never
        # waits for a lock, so it cannot hold the claim up.
        await conn.execute(QUERIES["heal_serial_keys"])
        if on_schedules is not None:
            # So does the scheduler's fallback; its answer arrives with the tenant locks'.
            probe = await conn.execute(QUERIES["schedule_probe"])
    if touch:
        await conn.execute(QUERIES["touch_worker"], {"worker_id": worker_id})
    if promote:
        # Runs whose time has come join the claim's index first (one index probe when none
        # has).
        await conn.execute(QUERIES["promote_due"])
        # So do waiting runs whose sleep ended or wait timed out (one index probe when none
        # has).
        await conn.execute(QUERIES["wake_due"])
    if handlers is None:
        # Read now, the locks' parameter: on a trip (which answers only once sent) in a
        # query of its own.
        ask = conn.connection if isinstance(conn, Trip) else conn
        cur = await ask.execute(QUERIES["ready_handlers"])
        names = [h for (h,) in await cur.fetchall()]
    else:
        names = list(handlers)
    locks = await conn.execute(QUERIES["lock_tenants"],
                               {"handlers": names, "limit": limit, "roomy": roomy})
    # A trip's locks are not sent yet either: a fault here still means nothing commits.
    faults.hit("claim.locked", conn.connection if isinstance(conn, Trip) else conn)
    params = {"limit": limit, "worker_id": worker_id, "lease_seconds": lease_seconds,
              "handlers": names}
    # Rows as tuples, in ClaimedRun's field order (claim_runs' columns): no dict per run.
    claimed: Rows
    if isinstance(conn, Trip):
        claimed = await conn.execute(QUERIES["claim_runs"], params)  # jsonb as text already
    else:
        cursor = conn.cursor()
        cursor.adapters.register_loader("jsonb", JsonText)
        await cursor.execute(QUERIES["claim_runs"], params)
        claimed = cursor
    return PendingClaim(claimed, probe, on_schedules,
                        locks if on_skipped is not None else None, on_skipped)


async def read_claimed(pending: PendingClaim | None) -> list[ClaimedRun]:
    """The runs a committed claim took (telling the schedules' probe first, if it rode)."""
    if pending is None:
        return []
    if pending.probe is not None and pending.on_schedules is not None:
        seen = await pending.probe.fetchone()
        if seen is not None:
            pending.on_schedules(seen[0], bool(seen[1]))
    if pending.locks is not None and pending.on_skipped is not None:
        # Skipped tenants come last (lock_tenants' order).
        rows = await pending.locks.fetchall()
        pending.on_skipped(bool(rows) and bool(rows[-1][2]))
    return [ClaimedRun(*row) for row in await pending.claimed.fetchall()]


async def claim(conn: psycopg.AsyncConnection[Any], *, limit: int, via: Via = "pipeline",
                **options: Any) -> list[ClaimedRun]:
    """Claim up to `limit` runs in one short transaction of their own (never held across
    handler code); `options` are claim_statements' (worker_id, lease_seconds, ...). `via`:
    how the statements travel (runpool.trips.Via): "pipeline", on any connection, turns JIT
    off for the transaction; "prepared" needs a worker session, which has it off already and
    pins read committed (db.WORKER_SESSION); "functions" needs this runpool's hot functions
    (runpool.pooled). Either of those is one simple query."""
    if limit <= 0:
        return []
    if via == "pipeline":
        # BEGIN, the reap, the tenant locks, the claim and COMMIT travel in one round trip.
        async with one_trip(conn):
            await conn.execute(NO_JIT)
            pending = await claim_statements(conn, limit=limit, **options)
    else:
        trip = Trip(conn, functions=via == "functions")
        pending = await claim_statements(trip, limit=limit, **options)
        await trip.send()
    faults.hit("claim.committed", conn)
    return await read_claimed(pending)
