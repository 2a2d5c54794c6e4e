"""Logs: RUNPOOL_LOG_FORMAT / RUNPOOL_LOG_LEVEL in real pool processes and the CLI."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import uuid
from typing import Any

import psycopg
import pytest

import runpool
from runpool.logs import RunContextFilter, run_log_context, setup_logging
from tests.helpers import ROOT, pool_env, run_row, running_pool, wait_for

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"


def _lines(text: str) -> list[dict[str, Any]]:
    """Every line of a JSON log, parsed (a line that is not one JSON object fails the test)."""
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_json_logs__every_line_parses_and_runs_carry_their_context(
        conn: psycopg.Connection, dsn: str) -> None:
    # A tenant holding a newline and quotes must not forge or split a line.
    hostile = 'evil\n{"action": "forged"}'
    plain = runpool.enqueue(conn, "acme", "logs", {"topic": "ducks"})
    traced = conn.execute(
        "SELECT runpool.enqueue('acme', 'logs', '{}', traceparent => %s)",
        (f"00-{TRACE_ID}-00f067aa0ba902b7-01",)).fetchone()[0]  # type: ignore[index]
    evil = runpool.enqueue(conn, hostile, "logs")
    failing = runpool.enqueue(conn, "acme", "fails")
    with running_pool(dsn, env={"RUNPOOL_LOG_FORMAT": "json",
                                "RUNPOOL_LOG_LEVEL": "debug"}) as pool:
        ids = [plain, traced, evil, failing]
        wait_for(lambda: all(run_row(conn, r)["status"] in ("succeeded", "failed")
                             for r in ids), what="runs done")
        wait_for(lambda: pool.log().count("from a thread") == 3, what="the handlers' lines")
        log = pool.log()
    lines = _lines(log)
    assert not any(line.get("action") == "forged" for line in lines)
    started = [d for d in lines if d.get("action") == "worker_started"]
    assert started and uuid.UUID(started[0]["worker_id"])
    worker_id = started[0]["worker_id"]
    assert {"ts", "level", "logger", "pid", "message"} <= set(started[0])

    def of(run_id: uuid.UUID, message: str) -> dict[str, Any]:
        (line,) = [d for d in lines if d.get("run_id") == str(run_id)
                   and d["message"].startswith(message)]
        return line

    # The handler's own logger, from its task and from a thread, gets the run's context.
    mine = of(plain, "thinking about ducks")
    assert mine["logger"] == "tests.apps.agent" and mine["level"] == "INFO"
    assert mine["tenant"] == "acme" and mine["attempt"] == 1 and mine["handler"] == "logs"
    assert mine["worker_id"] == worker_id
    # Tracing is off: the trace id is still the run's (derived from its id).
    assert mine["trace_id"] == plain.hex and "span_id" not in mine
    assert of(plain, "from a thread")["run_id"] == str(plain)
    assert of(traced, "from a thread")["trace_id"] == TRACE_ID
    assert of(evil, "thinking")["tenant"] == hostile
    # DEBUG reached the output (the level was honoured), and runpool's own records have
    # their action.
    assert any(d["level"] == "DEBUG" for d in lines)
    finished = of(failing, "run ")
    assert finished["action"] == "run_finished" and finished["attempt"] == 1


def test_text_logs__warning_level_hides_info(conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "logs")
    with running_pool(dsn, env={"RUNPOOL_LOG_LEVEL": "WARNING"}) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
        wait_for(lambda: "from a thread" in pool.log(), what="the warning")
        log = pool.log()
    assert "thinking about" not in log and "worker started" not in log
    (line,) = [x for x in log.splitlines() if "from a thread" in x]
    assert f"run_id={run_id}" in line and "tenant=acme" in line and "attempt=1" in line


@pytest.mark.parametrize(("variable", "value"), [("RUNPOOL_LOG_FORMAT", "xml"),
                                                 ("RUNPOOL_LOG_LEVEL", "LOUD")])
def test_cli__a_bad_log_setting_is_refused_naming_the_variable(
        dsn: str, variable: str, value: str) -> None:
    env = {**pool_env(dsn), variable: value}
    done = subprocess.run([sys.executable, "-m", "runpool", "status"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert variable in done.stderr and repr(value) in done.stderr


def test_cli__json_logs_of_a_command_parse(conn: psycopg.Connection, dsn: str) -> None:
    env = {**pool_env(dsn), "RUNPOOL_LOG_FORMAT": "json", "RUNPOOL_LOG_LEVEL": "DEBUG"}
    done = subprocess.run([sys.executable, "-m", "runpool", "migrate"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert all(isinstance(d, dict) for d in _lines(done.stderr))


def test_filter__outside_a_run_adds_nothing_inside_adds_the_run() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RunContextFilter())
    handler.setFormatter(logging.Formatter("%(message)s %(run_id)s"))
    log = logging.getLogger("tests.logs.filter")
    log.addHandler(handler)
    log.propagate = False
    try:
        with run_log_context(run_id="r-1", tenant="t"):
            log.warning("inside")
        log.warning("outside %s", "x", extra={"run_id": "explicit"})
    finally:
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == ["inside r-1", "outside x explicit"]


def test_setup_logging__defaults_to_text_info(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNPOOL_LOG_FORMAT", raising=False)
    monkeypatch.delenv("RUNPOOL_LOG_LEVEL", raising=False)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging()
        assert root.level == logging.INFO
        assert logging.getLogger("runpool").propagate
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)
