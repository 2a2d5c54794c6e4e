"""Lint and type-check as part of the suite: both are cheap, and both catch real bugs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT


def test_ruff__clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "runpool", "checkpoints", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.timeout(600)  # its own bound (300 s) counts, not the suite's default
def test_mypy_strict__clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# What the pool loads: the library's own modules, never the test toolkit or the harness.
_POOL_MODULES = """
import sys
import runpool, runpool.cli, runpool.pool, runpool.supervisor, runpool.worker
print("\\n".join(sorted(m for m in sys.modules if m.startswith("runpool"))))
"""


def test_the_pool_imports_nothing_from_the_harness_or_the_test_toolkit() -> None:
    out = subprocess.run([sys.executable, "-c", _POOL_MODULES], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    assert "runpool.worker" in out  # the listing is real
    assert [m for m in out if m.startswith(("runpool.testing", "runpool.harness"))] == []
