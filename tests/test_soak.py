"""The soak (`python -m runpool bench --soak`), short: random faults, then every invariant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from runpool.testing.pools import load_stretch
from tests.helpers import ROOT, pool_env


@pytest.mark.timeout(0)  # bounded by its own, load-stretched timeout below
def test_soak__a_short_soak_under_random_faults_keeps_every_invariant(server_dsn: str) -> None:
    out = subprocess.run(
        # 18 s of faults, and on until 150 runs came (a loaded machine is slower to get there).
        [sys.executable, "-m", "runpool", "bench", "--soak", "0.3", "--min-runs", "150",
         "--seed", "3", "--dsn", server_dsn],
        env=pool_env(server_dsn), cwd=ROOT, capture_output=True, text=True,
        timeout=400 * load_stretch())
    assert out.returncode in (0, 1), out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"], report["violations"]
    assert out.returncode == 0
    # A mix of real faults, not only cancels and refused input.
    real = {"worker_sigkill", "worker_sigstop", "pg_terminate_backend", "connections_cut",
            "blackhole"}
    assert len(real & {k for k, n in report["faults"].items() if n}) >= 3, report["faults"]
    # The host's listener process was killed under load at least once (and restarted: `ok`).
    assert report["faults"].get("listener_sigkill", 0) >= 1, report["faults"]
    assert sum(report["statuses"].values()) >= 100 and report["watch_samples"] > 100


@pytest.mark.timeout(600)  # its own bound (300 s) counts, not the suite's default
def test_bloat_soak__short_run_reports_sizes_latency_and_the_pinned_xmin(
        server_dsn: str, tmp_path: Path) -> None:
    plot = tmp_path / "soak.png"
    out = subprocess.run(
        [sys.executable, "-m", "runpool", "bench", "--soak", "0.2", "--bloat", "--every", "3",
         "--retention", "2", "--pin-xmin", "7", "--pin-at", "4", "--plot", str(plot),
         "--dsn", server_dsn],
        env=pool_env(server_dsn), cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    *samples, summary = lines
    assert len(samples) >= 3 and summary["workload"] == "soak-bloat"
    assert summary["pool_errors"] == 0 and summary["runs_done"] > 0
    assert summary["server_autovacuum"] in ("on", "off")
    # The snapshot held from 4 s to 11 s was seen, and `status` named its holder meanwhile.
    assert any(s["xmin_pinned"] for s in samples) and summary["xmin_warned"]
    assert all(s["claim_p99_ms"] is not None for s in samples)
    # CPU a run, read from /proc (the workers are this host's); claim buffers need the server
    # to preload pg_stat_statements, and are None without it.
    assert any((s["worker_cpu_ms_per_run"] or 0) > 0 for s in samples)
    assert all("claim_buffers" in s and "db_cpu_ms_per_run" in s for s in samples)
    assert {"runs", "messages", "tool_calls", "run_events", "status_events"} <= set(
        samples[-1]["tables"])
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot.with_suffix(".csv").read_text().startswith("t_s,runs_done,")
