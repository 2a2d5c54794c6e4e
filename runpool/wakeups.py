"""What the worker's claim loop is woken for, and what its next claim must do: promote due runs
or not, claim again after a held tenant was skipped."""

from __future__ import annotations

import asyncio
from typing import Final

from .leases import Cadence

__all__ = ["PROMOTE_INTERVAL", "SKIP_RETRY_MAX", "SKIP_RETRY_MIN", "Wakeups"]

# Seconds between the promotions of due runs (run_at, a retry's backoff, a durable sleep) by
# the claims that ride on a busy worker's outcome batches, and by the claims a doorbell wakes:
# two of the claim's statements, which would otherwise run in every batch and on every
# enqueue's wake-up (W2: four statements instead of six on its path) and nearly always find
# nothing. The worker's other claims (its first, a freed slot's, its own retry's timer, the
# poll) always promote: a run whose time came waits at most this much longer for its turn.
PROMOTE_INTERVAL: Final = 0.25
# Seconds before claiming again after a claim skipped a quota'd tenant whose row another
# transaction held (lock_tenants): usually another worker's claim, gone in a millisecond, so
# the first retry comes soon; doubling while the row stays held (an operator's open
# transaction), up to SKIP_RETRY_MAX. An operator's set_tenant_quota rings at its commit.
SKIP_RETRY_MIN: Final = 0.005
SKIP_RETRY_MAX: Final = 1.0


class Wakeups:
    """The claim loop's wake-ups besides the doorbell (which sets `attention` directly)."""

    def __init__(self, attention: asyncio.Event) -> None:
        self._attention = attention
        self._promote = Cadence(PROMOTE_INTERVAL)
        # Whether the loop's next claim promotes whatever PROMOTE_INTERVAL says.
        self._promote_next = True
        self._skip_delay = SKIP_RETRY_MIN
        self._skip_retry: asyncio.TimerHandle | None = None

    def promote(self, now: float, *, refill: bool) -> bool:
        """Whether a claim sent now promotes due runs (`refill`: one riding an outcome batch)."""
        if refill:
            return self._promote.due(now)
        if self._promote_next:
            self._promote_next = False
            self._promote.done(now)
            return True
        return self._promote.due(now)

    def polled(self) -> None:
        """The poll is due: its claim promotes."""
        self._promote_next = True

    def slot_freed(self) -> None:
        """The slot runner's wake-up: a slot freed, or its run's retry is due. Wakes the loop,
        whose claim promotes. Always: a freed slot whose outcome batch's refill came back short
        once claimed no more (W2: one claim fewer a run), but a doorbell that rang while no
        slot was free, between that refill and the vacate, was then lost until the poll
        (attack3: a run waited out a 30 s poll)."""
        self._promote_next = True
        self._attention.set()

    def skipped(self, skipped: bool) -> None:
        """Told after each claim: whether it skipped a quota'd tenant whose row was held. Its
        runs are claimed by a retry (nobody rings when a lock goes)."""
        if not skipped:
            self._skip_delay = SKIP_RETRY_MIN
            return
        if self._skip_retry is None:
            self._skip_retry = asyncio.get_running_loop().call_later(
                self._skip_delay, self._retry_skipped)
            self._skip_delay = min(self._skip_delay * 2, SKIP_RETRY_MAX)

    def _retry_skipped(self) -> None:
        self._skip_retry = None
        self._attention.set()
