"""Traces exported by real forked workers, decoded from real OTLP; the collector config."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml

import runpool
from runpool import otel_setup
from runpool.errors import InvalidInput
from tests.helpers import (
    ROOT,
    assert_invariants,
    pool_env,
    run_row,
    running_pool,
    scalar,
    wait_for,
)
from tests.otlp import GrpcReceiver, ReceivedSpan, Receiver

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
    # The messaging conventions' consumer attributes: the run is the message.
    assert second.attributes["messaging.system"] == "runpool"
    assert second.attributes["messaging.operation.type"] == "process"
    assert second.attributes["messaging.destination.name"] == "agent"
    assert second.attributes["messaging.message.id"] == str(run_id)
    # The GenAI conventions' agent span holds the attempt's tool calls.
    (agent,) = [s for s in spans if s.name == "invoke_agent agent"
                and s.parent_span_id == second.span_id]
    assert agent.attributes["gen_ai.operation.name"] == "invoke_agent"
    assert agent.attributes["gen_ai.agent.name"] == "agent"
    assert agent.attributes["gen_ai.conversation.id"] == str(run_id)
    # A checkpoint hit is an event where the tool call would have run: in the agent's span.
    hits = [e for e in agent.events if e[0] == "runpool.checkpoint.hit"]
    assert sorted(e[1]["gen_ai.tool.call.id"] for e in hits) == ["c0", "c1"]
    tools = [s for s in spans if s.trace_id == TRACE_ID and s.name == "execute_tool lookup"]
    (c2,) = [s for s in tools if s.attributes["gen_ai.tool.call.id"] == "c2"]
    assert c2.parent_span_id == agent.span_id
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


# -- the standard OTEL_* variables, each against a real receiver or a real worker process --

def _drained(pool: Any) -> None:
    pool.send_signal(signal.SIGTERM)  # workers flush their spans on the way out
    assert pool.wait(timeout=30) == 0


def test_otlp_grpc__spans_arrive_over_grpc_and_logs_carry_the_span(
        conn: psycopg.Connection, dsn: str) -> None:
    receiver = GrpcReceiver()
    endpoint = receiver.start()
    try:
        run_id = runpool.enqueue(conn, "acme", "logs")
        env = {**_otel(endpoint), "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
               "RUNPOOL_LOG_FORMAT": "json"}
        with running_pool(dsn, env=env) as pool:
            wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
            _drained(pool)
            log = pool.log()
        spans = _of_run(receiver.spans, run_id)
    finally:
        receiver.close()
    (process,) = [s for s in spans if s.name == "process logs"]
    (agent,) = [s for s in receiver.spans if s.name == "invoke_agent logs"]
    assert agent.parent_span_id == process.span_id and process.trace_id == run_id.hex
    assert process.resource["service.name"] == "runpool-test"
    # The handler's own log line names the span it was written in.
    (line,) = [json.loads(x) for x in log.splitlines() if "thinking about" in x]
    assert (line["trace_id"], line["span_id"]) == (agent.trace_id, agent.span_id)


def test_traces_exporter_none__nothing_is_exported(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    endpoint = receiver.start()
    run_id = runpool.enqueue(conn, "acme", "noop")
    with running_pool(dsn, env={**_otel(endpoint), "OTEL_TRACES_EXPORTER": "none"}) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
        _drained(pool)
    assert receiver.requests == 0


def test_console_and_otlp_with_resource_attributes(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    endpoint = receiver.start()
    run_id = runpool.enqueue(conn, "acme", "noop")
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "50",
           "OTEL_TRACES_EXPORTER": "console, otlp",
           "OTEL_RESOURCE_ATTRIBUTES": "service.name=billing-agents,"
                                       "deployment.environment.name=staging"}
    with running_pool(dsn, env=env) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
        _drained(pool)
        log = pool.log()
    (process,) = [s for s in _of_run(receiver.spans, run_id) if s.name == "process noop"]
    assert process.resource["service.name"] == "billing-agents"
    assert process.resource["deployment.environment.name"] == "staging"
    (worker_id,) = {str(w) for (w,) in conn.execute("SELECT id FROM runpool.workers")}
    assert process.resource["service.instance.id"] == worker_id
    # The console exporter printed the same span (the SDK's JSON, on stdout).
    assert '"name": "process noop"' in log and process.span_id in log


@pytest.mark.parametrize(("env", "expected"), [
    ({}, "runpool"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes"}, "from-attributes"),
    ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=from-attributes",
      "OTEL_SERVICE_NAME": "from-name"}, "from-name"),
])
def test_service_name__precedence(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                  expected: str) -> None:
    for name in ("OTEL_RESOURCE_ATTRIBUTES", "OTEL_SERVICE_NAME", "OTEL_TRACES_EXPORTER"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    provider = otel_setup.build_provider(uuid.uuid4())
    try:
        assert provider.resource.attributes["service.name"] == expected
    finally:
        provider.shutdown()


@pytest.mark.parametrize(("timeout", "gave_up"), [(None, (1.5, 5.0)), ("7", (6.0, 30.0))])
def test_otlp_timeout__the_variable_wins_over_runpools_short_default(
        conn: psycopg.Connection, dsn: str, receiver: Receiver, timeout: str | None,
        gave_up: tuple[float, float]) -> None:
    # A collector that never answers: the exporter gives up after runpool's 3 s unless
    # OTEL_EXPORTER_OTLP_TIMEOUT (seconds, as the Python SDK reads it) says otherwise.
    receiver.mode = "hang"
    endpoint = receiver.start()
    env = _otel(endpoint) | ({"OTEL_EXPORTER_OTLP_TIMEOUT": timeout} if timeout else {})
    run_id = runpool.enqueue(conn, "acme", "noop")
    with running_pool(dsn, env=env):
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
        wait_for(lambda: receiver.waited, timeout=40, what="the exporter to give up")
    low, high = gave_up
    assert low <= receiver.waited[0] <= high


@pytest.mark.parametrize(("variable", "value"), [
    ("OTEL_TRACES_EXPORTER", "zipkin"),
    ("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json"),
])
def test_pool__refuses_otel_settings_it_cannot_build_before_forking(
        dsn: str, variable: str, value: str) -> None:
    env = {**pool_env(dsn, app="tests.apps:app"), "OTEL_EXPORTER_OTLP_ENDPOINT": "http://x:1",
           variable: value}
    done = subprocess.run([sys.executable, "-m", "runpool", "worker"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert variable in done.stderr and value in done.stderr


def test_exporters__as_the_sdk_reads_the_variable() -> None:
    assert otel_setup.exporters({}) == ()
    assert otel_setup.exporters({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ("otlp",)
    assert otel_setup.exporters({"OTEL_TRACES_EXPORTER": "none",
                                "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}) == ()
    assert otel_setup.exporters({"OTEL_TRACES_EXPORTER": "OTLP,console,otlp"}) == (
        "otlp", "console")
    assert otel_setup.exporters({"OTEL_SDK_DISABLED": "true",
                                "OTEL_TRACES_EXPORTER": "console"}) == ()
    with pytest.raises(InvalidInput, match="OTEL_TRACES_EXPORTER"):
        otel_setup.exporters({"OTEL_TRACES_EXPORTER": "jaeger"})


def test_worker_metrics__exported_over_otlp_by_handler_and_outcome(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    endpoint = receiver.start()
    ok = [runpool.enqueue(conn, "acme", "noop") for _ in range(5)]
    refused = runpool.enqueue(conn, "acme", "fails")
    flaky = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 1})
    env = {**_otel(endpoint), "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    with running_pool(dsn, env=env, concurrency=2, retry_backoff_seconds=0.1) as pool:
        wait_for(lambda: all(run_row(conn, r)["status"] in ("succeeded", "failed")
                             for r in [*ok, refused, flaky]), what="runs done")
        finished = "runpool.runs.finished"
        expected = {(("runpool.handler", "noop"), ("runpool.run.outcome", "succeeded")): 5.0,
                    (("runpool.handler", "fails"), ("runpool.run.outcome", "failed")): 1.0,
                    (("runpool.handler", "flaky"), ("runpool.run.outcome", "retry")): 1.0,
                    (("runpool.handler", "flaky"), ("runpool.run.outcome", "succeeded")): 1.0}
        wait_for(lambda: receiver.latest(finished) == expected, timeout=20,
                 what="the finished counters")
        assert receiver.latest("runpool.run.attempts.started")[
            (("runpool.handler", "flaky"),)] == 2.0
        durations = receiver.latest("runpool.run.duration")
        assert durations[(("runpool.handler", "noop"), ("runpool.run.outcome", "succeeded"))] == 5
        assert sum(receiver.latest("runpool.claim.duration").values()) >= 1
        (worker_id,) = {str(w) for (w,) in conn.execute("SELECT id FROM runpool.workers")}
        assert receiver.latest("runpool.worker.slots") == {
            (("runpool.worker.id", worker_id),): 2.0}
        assert (("runpool.worker.id", worker_id),) in receiver.latest(
            "runpool.worker.slots.busy")
        _drained(pool)
    # No tenant label anywhere: callers choose tenants.
    assert not any("tenant" in str(a) for _, a, _ in receiver.points)


def test_metrics_exporter_none__traces_go_metrics_do_not(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    endpoint = receiver.start()
    run_id = runpool.enqueue(conn, "acme", "noop")
    env = {**_otel(endpoint), "OTEL_METRIC_EXPORT_INTERVAL": "100",
           "OTEL_METRICS_EXPORTER": "none"}
    with running_pool(dsn, env=env) as pool:
        wait_for(lambda: run_row(conn, run_id)["status"] == "succeeded", what="run done")
        _drained(pool)
    assert receiver.requests > 0 and receiver.metric_requests == 0


def test_worker_metrics__reclaims_lost_leases_cancels_and_waits_by_handler(
        conn: psycopg.Connection, dsn: str, receiver: Receiver) -> None:
    endpoint = receiver.start()
    # A reclaim: attempt 1 dies (os._exit) after a checkpoint; the restarted worker claims
    # attempt 2 once the lease expired. A retry after a failure (flaky) is no reclaim.
    crashed = runpool.enqueue(conn, "acme", "agent", {"steps": 2, "crash_after": 0})
    env = {**_otel(endpoint), "OTEL_METRIC_EXPORT_INTERVAL": "200"}
    with running_pool(dsn, env=env, lease_seconds=1.5, retry_backoff_seconds=0.1) as pool:
        wait_for(lambda: run_row(conn, crashed)["status"] == "succeeded", timeout=30,
                 what="the crashed run done")
        # Every figure below is the restarted worker's (the crashed one's counters died).
        flaky = runpool.enqueue(conn, "acme", "flaky", {"fail_times": 1})
        wait_for(lambda: run_row(conn, flaky)["status"] == "succeeded", what="flaky done")
        # A cancel, acted on by the (restarted) worker.
        held = runpool.enqueue(conn, "acme", "hold")
        wait_for(lambda: run_row(conn, held)["status"] == "running", what="hold running")
        assert scalar(conn, "SELECT runpool.cancel_run(%s, %s)", held, "stop") == "cancelling"
        wait_for(lambda: run_row(conn, held)["status"] == "cancelled", timeout=10,
                 what="cancelled")
        # A lost lease: the worker frozen past its lease notices when it thaws, gives the run
        # up, and (its own reaper returning it to the queue) reclaims it.
        slow = runpool.enqueue(conn, "acme", "sleep", {"seconds": 60})
        wait_for(lambda: run_row(conn, slow)["status"] == "running", what="sleep running")
        pid = scalar(conn, "SELECT w.pid FROM runpool.workers w JOIN runpool.runs r"
                     " ON r.worker_id = w.id WHERE r.id = %s", slow)
        frozen_until = scalar(conn, "SELECT lease_expires_at + interval '0.5 s'"
                              " FROM runpool.runs WHERE id = %s", slow)
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_for(lambda: scalar(conn, "SELECT now() > %s", frozen_until), interval=0.1,
                     what="the lease expired while frozen")
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_for(lambda: run_row(conn, slow)["attempt"] == 2, timeout=20, what="reclaimed")
        wait_for(lambda: receiver.latest("runpool.lease.lost") == {
            (("runpool.handler", "sleep"),): 1.0}, timeout=20, what="the lost lease's counter")
        wait_for(lambda: receiver.latest("runpool.runs.reclaimed") == {
            (("runpool.handler", "agent"),): 1.0, (("runpool.handler", "sleep"),): 1.0},
                 timeout=20, what="the reclaims")
        assert receiver.latest("runpool.cancels") == {(("runpool.handler", "hold"),): 1.0}
        assert receiver.latest("runpool.cancel.latency") == {
            (("runpool.handler", "hold"),): 1.0}
        # Both attempts' waits. Waited for, not read once: an export collects its instruments
        # one after another while the worker goes on, so the export that first showed the
        # reclaim could hold the wait histogram as it was just before that claim (CI, once:
        # 1 wait of "sleep" beside its reclaim); the next export has both.
        wait_for(lambda: {k: v for k, v in receiver.latest("runpool.run.wait").items()
                          if k in ((("runpool.handler", "flaky"),),
                                   (("runpool.handler", "sleep"),))} == {
            (("runpool.handler", "flaky"),): 2.0, (("runpool.handler", "sleep"),): 2.0},
                 timeout=10, what="both attempts' waits of flaky and of sleep")
        assert "action=lease_lost" in pool.log()
    assert not any("tenant" in str(a) for _, a, _ in receiver.points)
