"""Attack 2 on cost control's SQL: what a caller holding runpool_api (or a handler) can do to
a rate limit every tenant shares."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from tests.helpers import scalar


def _wait(conn: psycopg.Connection[Any], key: str) -> float:
    return float(scalar(conn, "SELECT wait FROM runpool.acquire_rate(%s)", key))


def test_attack2_release_rate__gives_back_at_most_the_last_reservation_once(
        conn: psycopg.Connection[Any]) -> None:
    """tat is readable (SELECT on rate_limits), so release_rate(key, huge, tat) erased the
    whole line: the next caller was admitted at once while three minutes of reservations
    were still to be used (the key's limit exceeded fourfold)."""
    conn.execute("SELECT runpool.set_rate_limit('shared', 60)")  # one a second, no burst
    for _ in range(3):
        conn.execute("SELECT runpool.acquire_rate('shared', 60)")
    for units in (1e9, 61.0, float("nan"), float("inf")):
        released = scalar(conn, "SELECT runpool.release_rate('shared', %s, tat)"
                                " FROM runpool.rate_limits WHERE key = 'shared'", units)
        assert released is None, units
    # The line is as it was: a newcomer waits for the three minutes reserved before it.
    assert _wait(conn, "shared") == pytest.approx(180, abs=2)
    # Its own reservation (the last, 1 unit) it may give back, once, and no more than it took.
    until = scalar(conn, "SELECT tat FROM runpool.rate_limits WHERE key = 'shared'")
    assert scalar(conn, "SELECT runpool.release_rate('shared', 2, %s)", until) is None
    assert scalar(conn, "SELECT runpool.release_rate('shared', 1, %s)", until) is True
    until = scalar(conn, "SELECT tat FROM runpool.rate_limits WHERE key = 'shared'")
    assert scalar(conn, "SELECT runpool.release_rate('shared', 1, %s)", until) is None
    assert _wait(conn, "shared") == pytest.approx(180, abs=2)
