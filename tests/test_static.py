"""Lint and type-check as part of the suite: both are cheap, and both catch real bugs."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT


def test_ruff__clean() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "runpool", "checkpoints", "tests"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_mypy_strict__clean() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
