"""How long one worker's claims took: a histogram with buckets 10 % apart, told on the worker's
last log line (`worker_stopped`, key `claims`) and merged across workers by the benchmarks
(W16's claim p50/p99). A claim is timed from asking the pool for a connection to its commit:
the loop's own claims and the refills riding on an outcome batch's transaction alike, since
the refills are most claims of a busy worker (and wait on the same tenant locks)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

__all__ = ["ClaimTimes", "merged_percentiles"]

# Bucket i holds durations up to FLOOR_MS * RATIO**i: 0.05 ms to ~17 min in 250 buckets.
FLOOR_MS: Final = 0.05
RATIO: Final = 1.1
BUCKETS: Final = 250


def _bucket(ms: float) -> int:
    if ms <= FLOOR_MS:
        return 0
    return min(math.ceil(math.log(ms / FLOOR_MS, RATIO)), BUCKETS - 1)


def _upper_ms(bucket: int) -> float:
    return FLOOR_MS * RATIO ** bucket


class ClaimTimes:
    """Counts per bucket (a fixed-size list: recording is an index and an increment)."""

    __slots__ = ("_counts", "empty", "runs")

    def __init__(self) -> None:
        self._counts = [0] * BUCKETS
        self.empty = 0
        self.runs = 0

    def record(self, seconds: float, claimed: int) -> None:
        self._counts[_bucket(seconds * 1000)] += 1
        self.runs += claimed
        if not claimed:
            self.empty += 1

    def summary(self) -> dict[str, Any]:
        """JSON-ready: the counts, and the buckets that are not empty (for merging)."""
        buckets = {str(i): n for i, n in enumerate(self._counts) if n}
        total = sum(self._counts)
        p50, p99, top = merged_percentiles([{"buckets": buckets}]) if total else (None,) * 3
        return {"n": total, "empty": self.empty, "runs": self.runs, "p50_ms": p50,
                "p99_ms": p99, "max_ms": top, "buckets": buckets}


def merged_percentiles(summaries: Iterable[Mapping[str, Any]]
                       ) -> tuple[float | None, float | None, float | None]:
    """p50, p99 and max (ms, each a bucket's upper bound: within 10 %) of several workers'
    summaries together; Nones when none of them timed a claim."""
    counts = [0] * BUCKETS
    for summary in summaries:
        for bucket, n in summary["buckets"].items():
            counts[int(bucket)] += int(n)
    total = sum(counts)
    if not total:
        return None, None, None

    def at(q: float) -> float:
        seen = 0
        for i, n in enumerate(counts):
            seen += n
            if seen >= q * total:
                return round(_upper_ms(i), 2)
        raise AssertionError("unreachable: q <= 1")

    top = max(i for i, n in enumerate(counts) if n)
    return at(0.5), at(0.99), round(_upper_ms(top), 2)
