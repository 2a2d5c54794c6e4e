"""Issue 20 item 5, the scaling curve: how cost grows with work. W1 (no-op runs) drained by 1, 2
and 4 workers, and W11 (agent-shaped runs) on 2 workers of 25 to 2,000 slots each, measured in
one sitting; each point is kept as a JSON line (with the machine's load average, which moves
every wall-clock figure on a shared machine) and drawn as docs/scaling-curve.png.

    python -m runpool.harness.scaling --dsn postgresql://postgres@127.0.0.1:5432/postgres \\
        --results docs/scaling-curve.jsonl --png docs/scaling-curve.png
    python -m runpool.harness.scaling --results docs/scaling-curve.jsonl \\
        --png docs/scaling-curve.png --plot-only
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

from .agent_workloads import w11_agent_load
from .throughput_workloads import w1_throughput

__all__ = ["POINTS", "main", "measure", "plot"]

# W11's own shape from 500 slots per worker up (5,000 runs of 20 turns); below it, four runs
# per slot, so a point takes about as long as a run's 20 turns and the database is not the
# limit: where checkpoint write p99 <= 20 ms can hold on this machine.
W11_RUNS: Final = 5000
W11_SMALL_RUNS_PER_SLOT: Final = 4
POINTS: Final[tuple[tuple[str, int], ...]] = (
    ("W1", 1), ("W1", 2), ("W1", 4),
    ("W11", 25), ("W11", 50), ("W11", 100), ("W11", 250),
    ("W11", 500), ("W11", 1000), ("W11", 2000),
)


def _point(server: str, workload: str, size: int) -> dict[str, Any]:
    if workload == "W1":
        return w1_throughput(server, workers=size)
    workers = 2
    runs = W11_RUNS if size >= 500 else W11_SMALL_RUNS_PER_SLOT * workers * size
    return w11_agent_load(server, workers=workers, slots=size, runs=runs)


def measure(server: str, results: Path, points: Sequence[tuple[str, int]] = POINTS,
            run: Callable[[str, str, int], dict[str, Any]] = _point) -> list[dict[str, Any]]:
    """Measure each point in turn, appending its JSON line to `results` as it comes."""
    got = []
    for workload, size in points:
        before = os.getloadavg()[0]
        row = {"point": workload, "size": size, **run(server, workload, size),
               "load_before": round(before, 2), "load_after": round(os.getloadavg()[0], 2)}
        with results.open("a") as out:
            out.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
        got.append(row)
    return got


def plot(rows: Sequence[dict[str, Any]], png: Path) -> None:
    """W1's drain rate and worker CPU per run against workers; W11's turns/s and checkpoint
    write p99 against slots per worker (log scales: the sizes double)."""
    import matplotlib  # the 'plot' extra; only the generator needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w1 = sorted((r for r in rows if r["point"] == "W1"), key=lambda r: r["size"])
    w11 = sorted((r for r in rows if r["point"] == "W11"), key=lambda r: r["size"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = [r["size"] for r in w1]
    left.plot(sizes, [r["runs_per_s"] for r in w1], "o-", color="tab:blue")
    left.set_xlabel("W1: workers (10 slots each)")
    left.set_ylabel("runs drained per s", color="tab:blue")
    left.set_xticks(sizes)
    left.set_ylim(bottom=0)
    cpu = left.twinx()
    cpu.plot(sizes, [r["worker_cpu_us_per_run"] for r in w1], "s--", color="tab:orange")
    cpu.set_ylabel("worker CPU per run (µs)", color="tab:orange")
    cpu.set_ylim(bottom=0)
    left.set_title("W1: no-op runs, 20,000 per point")
    slots = [r["size"] for r in w11]
    right.plot(slots, [r["turns_per_s"] for r in w11], "o-", color="tab:blue")
    right.set_xscale("log")
    right.set_xlabel("W11: slots per worker (2 workers)")
    right.set_ylabel("turns per s", color="tab:blue")
    right.set_xticks(slots, [str(s) for s in slots])
    right.set_ylim(bottom=0)
    lat = right.twinx()
    lat.plot(slots, [r["tool_call_p99_ms"] for r in w11], "s--", color="tab:red",
             label="tool call p99 (intent, tool, result)")
    # The checkpoint alone (the tool's result committed): points measured before W11
    # reported it have none.
    timed = [r for r in w11 if "checkpoint_p99_ms" in r]
    if timed:
        lat.plot([r["size"] for r in timed], [r["checkpoint_p99_ms"] for r in timed], "^:",
                 color="tab:purple", label="checkpoint write p99")
    lat.axhline(20, color="tab:red", linewidth=0.8, linestyle=":")
    lat.set_yscale("log")
    lat.set_ylim(bottom=1)
    lat.set_ylabel("p99, ms (dotted: 20 ms)", color="tab:red")
    lat.legend(loc="upper left", fontsize="small")
    right.set_title("W11: agent runs (20 turns, 0.2–2 s model sleep)")
    loads = [r["load_before"] for r in rows]
    fig.suptitle(f"runpool scaling, one sitting, 2 shared cores "
                 f"(load average {min(loads):.1f}–{max(loads):.1f})")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runpool.harness.scaling",
                                     description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--dsn", help="the PostgreSQL server to measure on (scratch databases)")
    parser.add_argument("--results", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--png", type=Path, required=True)
    parser.add_argument("--plot-only", action="store_true",
                        help="draw `--results` as they are; measure nothing")
    args = parser.parse_args(argv)
    if not args.plot_only:
        if not args.dsn:
            parser.error("--dsn is needed to measure")
        measure(args.dsn, args.results)
    rows = [json.loads(line) for line in args.results.read_text().splitlines() if line]
    plot(rows, args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
