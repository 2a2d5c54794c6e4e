"""Loads runpool/queries.sql once into named, static SQL strings."""

from __future__ import annotations

import re
from importlib.resources import files
from typing import Final, LiteralString, cast

_HEADER = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


def _load() -> dict[str, LiteralString]:
    # A package resource, so an installed wheel (or a zip) finds it too.
    text = (files("runpool") / "queries.sql").read_text(encoding="utf-8")
    parts = _HEADER.split(text)
    # parts = [preamble, name1, body1, name2, body2, ...]
    return {
        name: cast(LiteralString, body.strip().rstrip(";"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True)
    }


QUERIES: Final[dict[str, LiteralString]] = _load()
