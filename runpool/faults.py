"""Fault points: places where a reliability test makes a worker fail on purpose.

Nothing fires unless RUNPOOL_FAULTS arms it, so production code pays one dict lookup per
point. `RUNPOOL_FAULTS="point=action[@n],..."` fires `action` on the n-th hit of `point` in a
worker process (default: the first). With RUNPOOL_FAULTS_DIR set, a fired fault leaves a
marker file there and fires once per pool instead of once per process (a restarted worker
would otherwise hit it again and never get past it).

Points: claim.locked (the tenant locks sent, the claim statement not yet), claim.committed (the
claim is durable, no handler started yet), tool.intended (a tool call's intent committed, the
tool not yet started), tool.returned (the tool's side effect happened, its
result not yet committed), checkpoint.committed (a tool result and its message just
committed), outcome.committing (a batch of outcomes about to be written), schedule.enqueued (a
schedule's plan runs enqueued, its next_fire_at not yet advanced nor committed),
wait.committing (a durable wait about to be committed), wait.committed (a durable wait
committed: the run is 'waiting').
Actions: kill (SIGKILL this worker), stop (SIGSTOP it: a zombie until someone sends SIGCONT),
sever (shut down the socket of the connection in use, as a network cut would; only at
claim.locked and outcome.committing, where a statement follows on that connection and fails,
so the pool discards it).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .deadlines import sever
from .errors import InvalidInput

__all__ = ["POINTS", "armed", "hit"]

logger = logging.getLogger("runpool.faults")

POINTS = frozenset({"claim.locked", "claim.committed", "tool.intended", "tool.returned",
                    "checkpoint.committed", "outcome.committing", "schedule.enqueued",
                    "wait.committing", "wait.committed"})
_ACTIONS = frozenset({"kill", "stop", "sever"})
_SEVERABLE = frozenset({"claim.locked", "outcome.committing"})


@dataclass(frozen=True, slots=True)
class Fault:
    point: str
    action: str
    at: int


def parse(spec: str) -> dict[str, Fault]:
    faults: dict[str, Fault] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        point, _, rest = item.partition("=")
        action, _, at = rest.partition("@")
        if point not in POINTS:
            raise InvalidInput(f"RUNPOOL_FAULTS: unknown fault point {point!r}"
                               f" (known: {', '.join(sorted(POINTS))})")
        if action not in _ACTIONS:
            raise InvalidInput(f"RUNPOOL_FAULTS: unknown action {action!r} for {point}"
                               f" (known: {', '.join(sorted(_ACTIONS))})")
        if action == "sever" and point not in _SEVERABLE:
            raise InvalidInput(f"RUNPOOL_FAULTS: sever is not possible at {point}"
                               f" (only at {', '.join(sorted(_SEVERABLE))})")
        if at and not (at.isdigit() and int(at) >= 1):
            raise InvalidInput(f"RUNPOOL_FAULTS: {item!r}: the hit number must be >= 1")
        if point in faults:
            raise InvalidInput(f"RUNPOOL_FAULTS: {point} is armed twice")
        faults[point] = Fault(point, action, int(at or 1))
    return faults


@functools.cache
def armed() -> dict[str, Fault]:
    """The armed faults (parsed once per process; InvalidInput for a malformed spec)."""
    return parse(os.environ.get("RUNPOOL_FAULTS", ""))


_hits: dict[str, int] = {}


def hit(point: str, conn: Any = None) -> None:
    """Pass a fault point; fire its fault if one is armed for this hit."""
    fault = armed().get(point)
    if fault is None:
        return
    _hits[point] = count = _hits.get(point, 0) + 1
    if count != fault.at or not _first_in_pool(fault):
        return
    logger.warning("fault point %s fired: %s", point, fault.action,
                   extra={"action": "fault_fired", "point": point, "fault": fault.action})
    if fault.action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif fault.action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif conn is not None:
        sever(conn)


def _first_in_pool(fault: Fault) -> bool:
    directory = os.environ.get("RUNPOOL_FAULTS_DIR")
    if not directory:
        return True
    try:
        (Path(directory) / f"{fault.point}.fired").touch(exist_ok=False)
    except FileExistsError:
        return False
    return True
