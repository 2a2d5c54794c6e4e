"""A run in progress in a worker slot: the claim, the handler's Run, and its task."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .claiming import ClaimedRun
from .context import Run

__all__ = ["Slot"]


@dataclass(slots=True)
class Slot:
    """A run in progress. Written by the worker loop, heartbeat and cancel paths, all on the
    worker's one event loop, so no locking is needed."""

    claimed: ClaimedRun
    run: Run
    # Monotonic time after which the lease may have expired in the database.
    deadline: float
    task: asyncio.Task[None] | None = None
    # Why the worker cancelled the task: lease_lost, cancelled or shutdown.
    stop_reason: str | None = None
    # The outcome is being written; the heartbeat must not mistake it for a lost lease.
    finishing: bool = False
    # The worker gave up waiting for the run's threads: it exits, and they end with it.
    abandoned: bool = False
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.renew(self.deadline)

    def renew(self, deadline: float) -> None:
        """The lease may now run out at `deadline` (monotonic): the run's tools see it too."""
        self.deadline = deadline
        self.run._lease_until = deadline
