"""The migration files: migrations/NNNN_name.sql, shipped as package resources
(`runpool/migrations` is the top-level `migrations/` directory, copied into the wheel at build
time), so an installed runpool finds them wherever it lives. Apart from runpool.migrate, which
applies them: the hot statements' functions are named after the newest (runpool.trips).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from importlib.abc import Traversable
from importlib.resources import files
from typing import Final

from .errors import SchemaOutOfDate

__all__ = ["MIGRATIONS_DIR", "Migration", "latest_version", "migrations"]

MIGRATIONS_DIR: Final[Traversable] = files("runpool") / "migrations"
_NAME = re.compile(r"^(\d{4})_(\w+)\.sql$")


@dataclass(frozen=True, slots=True)
class Migration:
    version: int
    name: str
    sql: str


def migrations(directory: Traversable = MIGRATIONS_DIR) -> list[Migration]:
    found = []
    for entry in directory.iterdir():
        match = _NAME.match(entry.name)
        if match:
            found.append(Migration(int(match[1]), match[2], entry.read_text(encoding="utf-8")))
    if not found:
        # An installation without its migrations would call an empty database up to date
        # and let workers crash-loop on missing tables: refuse loudly instead.
        raise SchemaOutOfDate(f"no migrations found in {directory}: this runpool installation"
                              " is incomplete; reinstall it")
    return sorted(found, key=lambda m: m.version)


def latest_version(directory: Traversable = MIGRATIONS_DIR) -> int:
    """The newest migration's version (from the files' names alone: nothing read)."""
    versions = [int(m[1]) for entry in directory.iterdir() if (m := _NAME.match(entry.name))]
    return max(versions, default=0)
