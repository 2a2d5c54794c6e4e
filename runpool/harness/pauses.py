"""The cyclic garbage collector's pauses in this process, for W11 (runpool.harness.benchapp's
agent) to tell a checkpoint write that a pause stalled from one the load slowed: a collection
stops the worker's event loop, and every write in flight waits it out."""

from __future__ import annotations

import gc
import time
from typing import Any, Final

__all__ = ["paused_ms", "watch"]

# The latest pauses kept (perf_counter start, end): a W11 worker makes a few a second at most,
# and a write asks only about the last few hundred milliseconds.
KEPT: Final = 4096

# In order, and disjoint: collections never overlap, not even from two threads (CPython runs
# one at a time). A plain list, never changed but by appending: a reader in another thread
# walks it by index while a collection appends (a deque raised "mutated during iteration");
# trimming binds the name to a new list and leaves the reader's alone.
_pauses: list[tuple[float, float]] = []
_started: list[float] = []


def _timed(phase: str, info: dict[str, Any]) -> None:
    global _pauses
    if phase == "start":
        _started.append(time.perf_counter())
    elif _started:  # (a "stop" whose "start" came before watch(): not timed)
        _pauses.append((_started.pop(), time.perf_counter()))
        if len(_pauses) > 2 * KEPT:
            _pauses = _pauses[-KEPT:]


def watch() -> None:
    """Time this process's collections from now on (once; later calls do nothing)."""
    if _timed not in gc.callbacks:
        gc.callbacks.append(_timed)


def paused_ms(start: float, end: float) -> float:
    """How long collections stopped this process between two perf_counter readings (ms)."""
    total = 0.0
    for began, ended in reversed(_pauses):
        if ended <= start:
            break  # in order: every earlier pause ended before `start` too
        total += max(min(ended, end) - max(began, start), 0.0)
    return total * 1000
