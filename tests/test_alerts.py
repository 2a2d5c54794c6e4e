"""Dead-letter alerts: the outbox trigger, and delivery to a real HTTP receiver by real pools."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import psycopg
import pytest

import runpool
from runpool.alert_documents import Alert, batch_document
from runpool.alerts import PER_POST, backoff_seconds
from runpool.claiming import claim
from runpool.db import aconnect
from runpool.queries import QUERIES
from tests.helpers import live_workers, run_row, running_pool, scalar, wait_for

KEYS = {"id", "run_id", "tenant", "handler", "reason", "attempts", "text"}


@dataclass
class Webhook:
    """A real HTTP receiver: answers 503 to the first `fail_first` posts, then 200."""

    fail_first: int = 0
    # Never answer (until closed): a receiver that hangs.
    hang: bool = False
    _closing: threading.Event = field(default_factory=threading.Event)
    posts: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> str:
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                doc = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if hook.hang:
                    with hook._lock:
                        hook.posts.append((0, doc))
                    hook._closing.wait(60)
                    return
                with hook._lock:
                    status = 503 if len(hook.posts) < hook.fail_first else 200
                    hook.posts.append((status, doc))
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self._server.server_address[1]}/hooks/runpool"

    def close(self) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()

    def delivered(self) -> dict[str, dict[str, Any]]:
        """Each delivered alert's document by its run id (a post may carry a batch)."""
        with self._lock:
            return {a["run_id"]: a for s, d in self.posts if s == 200 for a in d["alerts"]}

    def alerts(self) -> list[tuple[int, dict[str, Any]]]:
        """Every alert posted, with the answer its post got."""
        with self._lock:
            return [(s, a) for s, d in self.posts for a in d["alerts"]]


@pytest.fixture
def webhook() -> Iterator[Webhook]:
    hook = Webhook()
    yield hook
    hook.close()


def _alerts(conn: psycopg.Connection) -> list[dict[str, Any]]:
    cur = conn.cursor(row_factory=psycopg.rows.dict_row)
    return cur.execute("SELECT * FROM runpool.alerts ORDER BY created_at").fetchall()


def test_webhook__failed_runs_are_delivered_once_a_failing_receiver_recovers(
        conn: psycopg.Connection, dsn: str, webhook: Webhook) -> None:
    webhook.fail_first = 2
    url = webhook.start()
    refused = runpool.enqueue(conn, "acme", "fails")
    exhausted = runpool.enqueue(conn, "beta", "always_raises", max_attempts=2)
    fine = runpool.enqueue(conn, "acme", "noop")
    failed = {str(refused), str(exhausted)}
    # Two worker processes: two senders sharing one outbox.
    with running_pool(dsn, workers=2, alert_webhook=url, retry_backoff_seconds=0.1) as pool:
        wait_for(lambda: set(webhook.delivered()) == failed, timeout=30,
                 what="every failure delivered")
        assert run_row(conn, fine)["status"] == "succeeded"
        wait_for(lambda: all(a["delivered_at"] for a in _alerts(conn)), what="marked delivered")
        log = pool.log()
    docs = webhook.delivered()
    for doc in docs.values():
        assert KEYS <= set(doc) and doc["run_id"] in doc["text"]
    assert docs[str(refused)]["reason"] == "failed"
    assert "refused by handler" in docs[str(refused)]["text"]
    assert docs[str(exhausted)]["attempts"] == 2 and docs[str(exhausted)]["tenant"] == "beta"
    assert "exception" in docs[str(exhausted)]["text"]
    # The posts refused by the receiver carried the same alert ids as the ones delivered, and
    # each alert was delivered once (two senders never took the same alert).
    ids = {d["run_id"]: d["id"] for d in docs.values()}
    assert all(ids[d["run_id"]] == d["id"] for _, d in webhook.alerts())
    assert sorted(d["id"] for s, d in webhook.alerts() if s == 200) == sorted(ids.values())
    rows = _alerts(conn)
    assert sorted(str(a["id"]) for a in rows) == sorted(ids.values())
    assert sum(a["tries"] for a in rows) == len(webhook.alerts())
    assert "alert_retry" in log and str(fine) not in {d["run_id"] for _, d in webhook.alerts()}
    # Two tenants, two posts each time: a post for one alert is that alert's own document.
    for _, post in webhook.posts:
        assert post["count"] == 1 and post["alerts"][0] == {
            k: v for k, v in post.items() if k not in ("count", "alerts")}


def _fail_runs(conn: psycopg.Connection, tenant: str, n: int) -> list[uuid.UUID]:
    """n queued runs of `tenant` failed in one transaction (the trigger writes n alerts)."""
    ids = runpool.enqueue_many(conn, [runpool.RunSpec(tenant, "noop") for _ in range(n)])
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                 " error = jsonb_build_object('reason', 'exception', 'message', 'boom')"
                 " WHERE id = ANY(%s)", (ids,))
    conn.commit()
    return ids


def test_flood__a_tenants_failures_go_in_batches_and_other_tenants_are_not_delayed(
        conn: psycopg.Connection, dsn: str, webhook: Webhook) -> None:
    # 1,000 failures of one tenant wait in the outbox, then one of another tenant.
    webhook.fail_first = 1
    url = webhook.start()
    flood = _fail_runs(conn, "flood", 1000)
    (quiet,) = _fail_runs(conn, "quiet", 1)
    with running_pool(dsn, alert_webhook=url):
        wait_for(lambda: len(webhook.delivered()) == 1001, timeout=60,
                 what="every alert delivered")
        wait_for(lambda: all(a["delivered_at"] for a in _alerts(conn)), what="marked delivered")
    posts = webhook.posts
    # A post a tenant a look: the flood's first batch (refused), and beside it, in the same
    # look, the quiet tenant's alert, not behind the flood's thousand.
    assert [(d["tenant"], d["count"]) for _, d in posts[:2]] == [("flood", PER_POST),
                                                                  ("quiet", 1)]
    assert posts[1][1]["run_id"] == str(quiet) and posts[1][0] == 200
    # Ten batches for a thousand alerts, plus the refused one again: not a thousand posts.
    assert len(posts) == 12 and all(d["count"] <= PER_POST for _, d in posts)
    assert sorted(webhook.delivered()) == sorted(map(str, [*flood, quiet]))
    # Delivered once each (the refused batch's alerts once more, with the same alert ids).
    delivered = [a["id"] for s, a in webhook.alerts() if s == 200]
    assert len(delivered) == len(set(delivered)) == 1001
    refused = {a["id"] for s, a in webhook.alerts() if s != 200}
    assert len(refused) == PER_POST and refused <= set(delivered)
    rows = {str(a["id"]): a for a in _alerts(conn)}
    assert all(rows[i]["tries"] == 2 for i in refused)
    for _, doc in posts:
        assert KEYS <= set(doc) and doc["run_id"] == doc["alerts"][0]["run_id"]
        # A batch: the first alert's keys, a text summing up all of them, each alert in full.
        if doc["count"] > 1:
            assert doc["text"].startswith(f":rotating_light: runpool: {doc['count']} runs of"
                                          " tenant `flood` failed: ")
            assert [a["failed_at"] for a in doc["alerts"]] == sorted(
                a["failed_at"] for a in doc["alerts"])
            assert all(KEYS <= set(a) for a in doc["alerts"])


def test_webhook__an_unreachable_receiver_backs_off_and_never_slows_the_pool(
        conn: psycopg.Connection, dsn: str) -> None:
    # A port nobody listens on.
    hook = Webhook()
    url = hook.start()
    hook.close()
    failed = runpool.enqueue(conn, "acme", "fails")
    with running_pool(dsn, alert_webhook=url):
        wait_for(lambda: (_alerts(conn) or [{"tries": 0}])[0]["tries"] >= 2, timeout=20,
                 what="a retried alert")
        ids = [runpool.enqueue(conn, "acme", "noop") for _ in range(20)]
        wait_for(lambda: all(run_row(conn, r)["status"] == "succeeded" for r in ids),
                 what="runs go on")
    (alert,) = _alerts(conn)
    assert alert["run_id"] == failed and alert["delivered_at"] is None
    assert "unreachable" in alert["last_error"]


def test_webhook__a_receiver_that_hangs_holds_only_the_senders_thread(
        conn: psycopg.Connection, dsn: str, webhook: Webhook) -> None:
    webhook.hang = True
    url = webhook.start()
    failed = runpool.enqueue(conn, "acme", "fails")
    with running_pool(dsn, alert_webhook=url):
        wait_for(lambda: webhook.posts, what="the post in flight")
        # While the post hangs, runs go on, and the failures they make are written.
        ids = [runpool.enqueue(conn, "acme", "noop") for _ in range(20)]
        more = runpool.enqueue(conn, "acme", "fails")
        wait_for(lambda: all(run_row(conn, r)["status"] == "succeeded" for r in ids)
                 and run_row(conn, more)["status"] == "failed", what="runs go on")
        assert len(_alerts(conn)) == 2
    assert [d["run_id"] for _, d in webhook.posts] == [str(failed)]


def test_webhook__a_receiver_answering_garbage_is_retried_and_the_worker_lives(
        conn: psycopg.Connection, dsn: str) -> None:
    # Not HTTP at all: http.client raises BadStatusLine, which is no OSError.
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def answer() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                peer, _ = server.accept()
            except TimeoutError:
                continue
            with peer:
                peer.recv(65536)
                peer.sendall(b"garbage\r\n\r\n")

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    try:
        url = f"http://127.0.0.1:{server.getsockname()[1]}/"
        runpool.enqueue(conn, "acme", "fails")
        with running_pool(dsn, alert_webhook=url) as pool:
            wait_for(lambda: (_alerts(conn) or [{"tries": 0}])[0]["tries"] >= 2, timeout=20,
                     what="a retried alert")
            (worker,) = live_workers(conn)
            late = runpool.enqueue(conn, "acme", "noop")
            wait_for(lambda: run_row(conn, late)["status"] == "succeeded", what="runs go on")
            assert live_workers(conn) == [worker] and "side_task_failed" not in pool.log()
    finally:
        stop.set()
        answering.join(timeout=5)
        server.close()
    (alert,) = _alerts(conn)
    assert alert["delivered_at"] is None and "BadStatusLine" in alert["last_error"]


def test_outbox__the_reapers_failure_writes_the_alert_in_its_own_transaction(
        conn: psycopg.Connection, dsn: str) -> None:
    run_id = runpool.enqueue(conn, "acme", "sleep", max_attempts=1)

    async def take() -> None:
        async with await aconnect(dsn, autocommit=True) as c:
            await claim(c, worker_id=uuid.uuid4(), limit=1, lease_seconds=30)
    asyncio.run(take())
    conn.execute("UPDATE runpool.runs SET lease_expires_at = now() - interval '1 second'"
                 " WHERE id = %s", (run_id,))
    conn.commit()
    # Rolled back: no failure, no alert.
    with conn.transaction(force_rollback=True):
        assert scalar(conn, QUERIES["reap_expired"]) == 1
        assert len(_alerts(conn)) == 1
    assert _alerts(conn) == [] and run_row(conn, run_id)["status"] == "running"
    assert scalar(conn, QUERIES["reap_expired"]) == 1
    (alert,) = _alerts(conn)
    assert (alert["run_id"], alert["reason"], alert["attempts"], alert["tenant"]) == (
        run_id, "lease_expired", 1, "acme")
    assert alert["delivered_at"] is None and alert["tries"] == 0
    # Failing again after a retry is a new alert; staying failed (a no-op update) is not.
    assert scalar(conn, "SELECT runpool.retry_run(%s)", run_id) == "queued"
    conn.execute("UPDATE runpool.runs SET status = 'failed', finished_at = now(),"
                 " error = '\"not an object\"' WHERE id = %s", (run_id,))
    conn.execute("UPDATE runpool.runs SET status = 'failed' WHERE id = %s", (run_id,))
    second = _alerts(conn)[1]
    assert len(_alerts(conn)) == 2 and second["id"] != alert["id"]
    assert second["reason"] is None


def test_outbox__nobody_but_the_trigger_writes_alerts(conn: psycopg.Connection) -> None:
    for role in ("runpool_api", "runpool_worker"):
        with conn.transaction(force_rollback=True):
            conn.execute(psycopg.sql.SQL("SET LOCAL ROLE {}").format(psycopg.sql.Identifier(role)))
            with pytest.raises(psycopg.errors.InsufficientPrivilege):
                conn.execute("INSERT INTO runpool.alerts (run_id, tenant, handler, attempts)"
                             " VALUES (gen_random_uuid(), 't', 'h', 1)")


def test_document__slack_text_escapes_what_callers_wrote() -> None:
    alert = Alert(id="a1", run_id="r1", tenant="<!channel> & co", handler="h<x>",
                  reason="handler_failed", message="see <http://evil|here>", attempts=1,
                  tries=1, failed_at="2026-11-30T00:00:00+00:00")
    doc = alert.document()
    assert KEYS <= set(doc) and doc["tenant"] == "<!channel> & co"
    assert "<" not in doc["text"] and "&lt;!channel&gt; &amp; co" in doc["text"]
    assert "1 attempt)" in doc["text"]


def _alert(i: int, tenant: str = "acme", reason: str = "exception",
           handler: str = "research") -> Alert:
    return Alert(id=str(uuid.UUID(int=i)), run_id=f"r{i}", tenant=tenant, handler=handler,
                 reason=reason, message=f"message {i}", attempts=1, tries=1,
                 failed_at=f"2026-11-30T00:00:{i:02d}+00:00")


def test_document__one_alert_is_posted_as_before_batching() -> None:
    alert = _alert(1)
    doc = batch_document([alert])
    assert doc == {**alert.document(), "count": 1, "alerts": [alert.document()]}
    assert doc["id"] == alert.id


def test_document__a_batch_sums_up_its_alerts_with_a_stable_id() -> None:
    alerts = [_alert(i, reason="lease_expired" if i % 4 == 0 else "exception",
                     handler=f"h<{i % 7}>") for i in range(1, 41)]
    doc = batch_document(alerts)
    assert KEYS <= set(doc) and doc["count"] == 40
    assert [a["id"] for a in doc["alerts"]] == [a.id for a in alerts]
    assert (doc["run_id"], doc["handler"], doc["message"]) == ("r1", "h<1>", "message 1")
    # The same alerts (in any order) make the same batch id; another set another id.
    assert doc["id"] == batch_document(alerts[::-1])["id"] != batch_document(alerts[1:])["id"]
    assert doc["id"] not in {a.id for a in alerts}
    text = doc["text"]
    assert "40 runs of tenant `acme` failed: 30 `exception`, 10 `lease_expired`" in text
    # Five handlers and five runs named, the rest counted; tenants' text escaped.
    assert "(handlers: 6 `h&lt;1&gt;`, 6 `h&lt;2&gt;`" in text and "and 2 more" in text
    assert "<" not in text
    assert "runs `r1`, `r2`, `r3`, `r4`, `r5` and 35 more" in text
    assert len(text) < 1000


def test_backoff__grows_and_is_capped() -> None:
    assert 0.5 <= backoff_seconds(1) <= 1.0
    assert 4 <= backoff_seconds(4) <= 8
    assert 150 <= backoff_seconds(40) <= 300
