"""Tests that need a system program (a browser, pgbouncer, ...): skipped with a message
naming the Debian package that provides it, unless RUNPOOL_TEST_REQUIRE_SYSTEM=1 (CI, whose
.ci/run installs them), under which a missing program fails the test instead."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

__all__ = ["require_program", "require_root"]


def _missing(message: str) -> None:
    if os.environ.get("RUNPOOL_TEST_REQUIRE_SYSTEM") == "1":
        pytest.fail(f"{message}; RUNPOOL_TEST_REQUIRE_SYSTEM=1 requires it")
    pytest.skip(message)


def require_program(path: str, package: str) -> str:
    """path, if that program is installed; otherwise skip (or fail, when required)."""
    if Path(path).is_file() and os.access(path, os.X_OK):
        return path
    _missing(f"{path} is missing: install the Debian package {package!r}"
             f" (apt-get install {package})")
    raise AssertionError("unreachable")  # pragma: no cover (skip and fail raise)


def require_root(what: str) -> None:
    """Skip (or fail, when required) unless this process is root: `what` needs it."""
    if os.geteuid() != 0:
        _missing(f"{what} needs root (network namespaces, clusters run as user postgres)")
