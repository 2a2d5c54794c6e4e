"""Loads a package's named SQL file (runpool/queries.sql and the like) once into static SQL
strings."""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Final, LiteralString, cast

__all__ = ["QUERIES", "load"]

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def load(package: str, resource: str) -> dict[str, LiteralString]:
    """The statements of a `-- name: x` headed SQL file shipped in `package`."""
    # A package resource, so an installed wheel (or a zip) finds it too.
    text = (files(package) / resource).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {
        name: cast(LiteralString, body.strip().rstrip(";"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


QUERIES: Final[dict[str, LiteralString]] = load("runpool", "queries.sql")
