"""JSON to and from the database: orjson, refusing what jsonb cannot store, wired into psycopg."""

from __future__ import annotations

import json
import re
from typing import Any, Final

import orjson
from psycopg.abc import AdaptContext
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads

from .errors import InvalidInput

__all__ = ["configure", "dumps", "encode", "jsonb", "loads", "loads_exact"]


# A NUL escape in JSON text: \u0000 preceded by an even number of backslashes (an odd number
# would make it the escaped text "\\u0000", which is fine).
_NUL_ESCAPE = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")


# Values orjson writes itself, holding no Fragment: their text needs no second look. Exact
# types: a subclass of float that is also an Enum or a dataclass, say, is written as its value
# or its fields, which may be a Fragment.
_PLAIN: Final = frozenset({str, int, float, bool, type(None)})
_UNREAD: Final[Any] = object()


def _dumps(value: Any) -> tuple[bytes, Any]:
    """dumps(), and the value its text decodes to (_UNREAD for a plain scalar, not read)."""
    try:
        data = orjson.dumps(value)
    except TypeError as exc:
        raise InvalidInput(f"not JSON-serialisable: {exc}") from None
    # An orjson.Fragment is spliced in as it is, unchecked: text that is not one JSON value
    # (say `1},{"run_id": ...`) would carry writes for another run into a batch's JSON array
    # (checkpoints.store._row). One parse of the text refuses it; the parse costs ~1 us for a
    # message of a few hundred bytes (0.4-1.1 ms a MB, more for many small objects), and only
    # values that are not a plain scalar pay it, since orjson cannot say whether a Fragment is
    # inside. (encode() hands the parse back as the value committed.)
    read = _UNREAD
    if type(value) not in _PLAIN:
        try:
            read = orjson.loads(data)
        except orjson.JSONDecodeError as exc:
            raise InvalidInput(f"not one JSON value (an orjson.Fragment?): {exc}") from None
    # jsonb rejects \u0000; catching it here keeps the caller's transaction intact.
    if b"\\u0000" in data and _NUL_ESCAPE.search(data):
        raise InvalidInput("JSON text contains a NUL character (\\u0000), which jsonb rejects")
    return data, read


def dumps(value: Any) -> bytes:
    """Serialise a JSON value, refusing what PostgreSQL's jsonb cannot store."""
    return _dumps(value)[0]


def encode(value: Any) -> tuple[bytes, Any]:
    """dumps(), and the JSON value as it will be read back (a tuple becomes a list, a
    dataclass a dict): what a handler is given of what it committed, decoded by the same
    parse that checks the text."""
    data, read = _dumps(value)
    return data, (loads(data) if read is _UNREAD else read)


def _as_is(data: Any) -> Any:
    return data


def jsonb(data: bytes) -> Jsonb:
    """JSON already serialised by dumps(), as a jsonb parameter (not serialised again)."""
    return Jsonb(data, dumps=_as_is)


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    return orjson.loads(bytes(data) if isinstance(data, memoryview) else data)


# Every byte to b"0" but the ASCII digits, which become b"1": with it, one C-speed translate and
# one substring search find a run of 19 digits, the shortest integer beyond orjson's 64 bits
# (-2**63 - 1 has 19 digits, 2**64 has 20).
_DIGITS: Final = bytes(0x31 if 0x30 <= b <= 0x39 else 0x30 for b in range(256))
_LONG_DIGITS: Final = b"1" * 19


def loads_exact(data: bytes) -> Any:
    """loads(), but integers beyond 64 bits come back exact: orjson turns them into floats
    (123456789012345678901234567890 into 1.2345678901234568e+29). Only text holding 19 digits
    in a row (a long number, or a long digit string) is decoded again, with the standard json
    module: for the common input this costs one pass over the bytes, under a microsecond for a
    small one. For a run's input, decoded once per attempt: JSON runpool's Python API writes
    cannot hold such integers (orjson refuses them: InvalidInput), an input enqueued through
    SQL can."""
    value = orjson.loads(data)
    if _LONG_DIGITS in data.translate(_DIGITS):
        try:
            return json.loads(data)
        except RecursionError:  # nesting orjson accepts (up to 1,024) but json does not
            raise ValueError("JSON nested too deeply to decode its long integers") from None
    return value


def configure(context: AdaptContext) -> None:
    """The one place orjson is wired into psycopg (for a connection, or globally with None)."""
    set_json_dumps(dumps, context)
    set_json_loads(loads, context)
