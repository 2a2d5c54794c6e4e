"""Traces exported by real forked workers, decoded from real OTLP; the collector config."""

from __future__ import annotations

import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import yaml

import runpool
from tests.helpers import ROOT, assert_invariants, run_row, running_pool, scalar, wait_for
from tests.otlp import ReceivedSpan, Receiver

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _otel(endpoint: str) -> dict[str, str]:
    # Export promptly so the test need not wait for the default 5 s batch delay.
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_SERVICE_NAME": "runpool-test",
            "OTEL_BSP_SCHEDULE_DELAY": "50"}


def _of_run(spans: list[ReceivedSpan], run_id: uuid.UUID) -> list[ReceivedSpan]:
    return [s for s in spans if s.attributes.get("runpool.run.id") == str(run_id)]


def test_trace__one_trace_across_a_reclaim_with_genai_tool_spans(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    traceparent = f"00-{TRACE_ID}-{PARENT}-01"
    run_id = scalar(conn, "SELECT runpool.enqueue('acme', 'agent', %s, traceparent => %s)",
                    psycopg.types.json.Jsonb({"steps": 3, "crash_after": 1}), traceparent)
    endpoint = receiver.start()
    with running_pool(dsn, lease_seconds=1.5, env=_otel(endpoint)) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", timeout=30,
                 what="resumed run")
        plain = runpool.enqueue(conn, "acme", "noop")  # no trace context at all
        wait_for(lambda: run_row(conn, plain)["status"] == "succeeded", what="plain run")
        pool.send_signal(signal.SIGTERM)  # workers flush their spans on the way out
        assert pool.wait(timeout=30) == 0
    spans = receiver.spans
    process = [s for s in _of_run(spans, run_id) if s.name == "process agent"]
    # Attempt 1 died by os._exit (its span never ended); attempt 2's span is the resumed one.
    (second,) = [s for s in process if s.attributes["runpool.run.attempt"] == 2]
    assert second.trace_id == TRACE_ID and second.parent_span_id == PARENT
    assert second.attributes["runpool.tenant"] == "acme"
    assert second.attributes["runpool.handler"] == "agent"
    assert second.attributes["runpool.run.outcome"] == "succeeded"
    hits = [e for e in second.events if e[0] == "runpool.checkpoint.hit"]
    assert sorted(e[1]["gen_ai.tool.call.id"] for e in hits) == ["c0", "c1"]
    tools = [s for s in spans if s.trace_id == TRACE_ID and s.name == "execute_tool lookup"]
    (c2,) = [s for s in tools if s.attributes["gen_ai.tool.call.id"] == "c2"]
    assert c2.parent_span_id == second.span_id
    assert c2.attributes["gen_ai.operation.name"] == "execute_tool"
    assert c2.attributes["gen_ai.tool.name"] == "lookup"
    # Whatever attempt 1 exported before it died belongs to the same trace.
    assert all(s.trace_id == TRACE_ID for s in tools)
    # A run enqueued with no trace context still has one trace: its id is the run id.
    (noop,) = [s for s in _of_run(spans, plain) if s.name == "process noop"]
    assert noop.trace_id == plain.hex
    # No inputs or idempotency keys in span attributes.
    assert not any(str(run_id) + ":" in str(v) for s in spans for v in s.attributes.values())


@pytest.mark.parametrize("mode", ["unavailable", "hang"])
def test_collector_down__runs_unaffected_and_workers_exit_cleanly(
        conn: psycopg.Connection, dsn: str, receiver: Receiver, mode: str) -> None:
    receiver.mode = mode
    endpoint = receiver.start()
    ids = [runpool.enqueue(conn, "acme", "noop") for _ in range(30)]
    with running_pool(dsn, workers=2, env=_otel(endpoint)) as pool:
        wait_for(lambda: scalar(conn, "SELECT count(*) FROM runpool.runs"
                                " WHERE status = 'succeeded'") == len(ids),
                 timeout=20, what="runs done despite the collector")
        wait_for(lambda: receiver.requests > 0, what="export attempted")
        pool.send_signal(signal.SIGTERM)
        assert pool.wait(timeout=40) == 0
    assert_invariants(conn)


def test_collector_config__otlp_in_batch_jaeger_out() -> None:
    config = yaml.safe_load(Path(ROOT, "otel-collector.yaml").read_text())
    protocols = config["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "0.0.0.0:4317"
    assert protocols["http"]["endpoint"] == "0.0.0.0:4318"
    assert "batch" in config["processors"]
    exporter = config["exporters"]["otlp/jaeger"]
    assert exporter["endpoint"].endswith(":4317") and exporter["tls"]["insecure"] is True
    assert "jaeger" not in config["exporters"]  # the removed exporter
    pipeline = config["service"]["pipelines"]["traces"]
    assert pipeline == {"receivers": ["otlp"], "processors": ["batch"],
                        "exporters": ["otlp/jaeger"]}
