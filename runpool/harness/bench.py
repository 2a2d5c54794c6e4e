"""`python -m runpool bench`: the benchmarks, one JSON line per workload.

Each workload runs in a scratch database created on the configured server (or the embedded
one) and dropped afterwards. Nothing here asserts a time: the numbers are reported, and the
README records them with the machine they came from.
"""

from __future__ import annotations

import json

from ..embedded import resolve_dsn
from ..settings import Settings
from .measure import median_of
from .wait_bench import w14_waits
from .workloads import WORKLOADS as BASE

# W14 lives in its own module (durable waits); every other workload in workloads.
WORKLOADS = {**BASE, "W14": w14_waits}

__all__ = ["run_bench"]


def run_bench(settings: Settings, workloads: list[str] | None, *, repeat: int = 1) -> int:
    server = resolve_dsn(settings)
    names = workloads or list(WORKLOADS)
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise SystemExit(f"unknown workload(s) {unknown}; known: {', '.join(WORKLOADS)}")
    for name in names:
        results = [WORKLOADS[name](server) for _ in range(max(repeat, 1))]
        print(json.dumps(median_of(results)), flush=True)
    return 0
