"""The scaling curve's harness (runpool.harness.scaling): each point appended as a JSON line as
it comes, and the plot drawn from them, old points (without a checkpoint p99) and new alike."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from runpool.harness.scaling import measure, plot


def _fake(server: str, workload: str, size: int) -> dict[str, Any]:
    if workload == "W1":
        return {"runs_per_s": 1000.0 * size, "worker_cpu_us_per_run": 90.0}
    row = {"turns_per_s": 2.0 * size, "tool_call_p99_ms": 10.0 + size / 10}
    if size >= 100:  # as W11 reports since session 10
        row["checkpoint_p99_ms"] = 5.0 + size / 20
    return row


def test_measure_appends_each_point_and_plot_draws_old_and_new_rows(tmp_path: Path) -> None:
    results, png = tmp_path / "curve.jsonl", tmp_path / "curve.png"
    results.write_text(json.dumps({"point": "W11", "size": 25, "turns_per_s": 40,
                                   "tool_call_p99_ms": 227, "load_before": 18.8,
                                   "load_after": 16.2}) + "\n")
    points = (("W1", 1), ("W1", 2), ("W11", 50), ("W11", 100), ("W11", 1000))
    got = measure("postgresql://unused", results, points, run=_fake)
    assert [(r["point"], r["size"]) for r in got] == list(points)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert len(rows) == 6 and all("load_before" in r and "load_after" in r for r in rows)
    plot(rows, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
