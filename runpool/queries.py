"""Loads a package's named SQL file (runpool/queries.sql and the like) once into static SQL
strings."""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Final, LiteralString

__all__ = ["QUERIES", "load"]

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)
# A whole-line comment after a statement's first line (the purpose, kept: pg_stat_activity
# shows it to an operator, and tools find a statement by it).
_COMMENT = re.compile(r"(?<=\n)[ \t]*--[^\n]*\n")


def load(package: str, resource: str) -> dict[str, LiteralString]:
    """The statements of a `-- name: x` headed SQL file shipped in `package`."""
    # A package resource, so an installed wheel (or a zip) finds it too.
    text = (files(package) / resource).read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {
        name: _sent(body)
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


def _sent(body: str) -> LiteralString:
    """A statement as sent: without its whole-line comments but the first. psycopg converts a
    query of more than 4,096 characters anew on every execution (its cache skips them):
    claim_runs (6.5k with its comments) and finish_runs (4.1k) were parsed by a regular
    expression in every outcome batch, ~50 us each on this machine (micro-benchmark of
    cursor._convert_query)."""
    # (Static text with comments removed is static text; mypy reads LiteralString as str.)
    return _COMMENT.sub("", body.strip().rstrip(";") + "\n").rstrip()


QUERIES: Final[dict[str, LiteralString]] = load("runpool", "queries.sql")
