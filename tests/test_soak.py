"""The soak (`python -m runpool bench --soak`), short: random faults, then every invariant."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT, pool_env


def test_soak__a_short_soak_under_random_faults_keeps_every_invariant(server_dsn: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "runpool", "bench", "--soak", "0.3", "--seed", "3",
         "--dsn", server_dsn],
        env=pool_env(server_dsn), cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode in (0, 1), out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ok"], report["violations"]
    assert out.returncode == 0
    # A mix of real faults, not only cancels and refused input.
    real = {"worker_sigkill", "worker_sigstop", "pg_terminate_backend", "connections_cut",
            "blackhole"}
    assert len(real & {k for k, n in report["faults"].items() if n}) >= 3, report["faults"]
    assert sum(report["statuses"].values()) >= 100 and report["watch_samples"] > 100
