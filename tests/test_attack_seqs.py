"""Attack on 0017/0018's event seqs: a run's first counter row made by a write that commits
after a status statement took its snapshot, but before that statement locked the run row."""

from __future__ import annotations

import threading
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import checkpoints
from runpool.db import connect
from runpool.enqueue import enqueue
from runpool.queries import QUERIES
from runpool.testing import wait_for

from .helpers import scalar

CLAIM_ONE = ("UPDATE runpool.runs SET status = 'running', attempt = attempt + 1, worker_id = %s,"
             " lease_expires_at = now() + interval '1 minute' WHERE id = %s")
# Every numbered event of a run: its status events, messages and tool call starts and ends.
SEQS = """
SELECT seq FROM runpool.status_history WHERE run_id = %(run_id)s
UNION ALL SELECT event_seq FROM runpool.messages WHERE run_id = %(run_id)s
UNION ALL SELECT started_seq FROM runpool.tool_calls WHERE run_id = %(run_id)s
UNION ALL SELECT finished_seq FROM runpool.tool_calls
          WHERE run_id = %(run_id)s AND finished_seq IS NOT NULL
ORDER BY 1
"""


def _seqs(conn: psycopg.Connection[Any], run_id: uuid.UUID) -> list[int]:
    return [s for (s,) in conn.execute(SEQS, {"run_id": run_id})]


def _blocked(conn: psycopg.Connection[Any], pid: int) -> bool:
    return bool(scalar(conn, "SELECT wait_event_type = 'Lock' FROM pg_stat_activity"
                             " WHERE pid = %s", pid))


def test_release_waiting_for_a_first_checkpoint_numbers_after_it(dsn: str) -> None:
    """A draining worker's release_runs waits for the run row a first checkpoint write holds
    share-locked (its fence); that write makes the run's counter row and commits; the release
    then takes the run's next seq, not the write's again."""
    worker = uuid.uuid4()
    with connect(dsn, autocommit=True) as conn, connect(dsn) as writer, \
            connect(dsn, autocommit=True) as releaser:
        run_id = enqueue(conn, "acme", "noop")
        conn.execute(CLAIM_ONE, (worker, run_id))
        assert _seqs(conn, run_id) == [2]
        # The run's first checkpoint: its counter row made, uncommitted, the run row held.
        first = checkpoints.message_write(run_id, 1, "user", Jsonb("hi"))
        assert scalar(writer, first.query, first.params) == 1
        pid = releaser.info.backend_pid
        done: list[int] = []
        release = threading.Thread(target=lambda: done.append(scalar(
            releaser, QUERIES["release_runs"],
            {"ids": [run_id], "attempts": [1], "worker_id": worker})), daemon=True)
        release.start()
        wait_for(lambda: _blocked(conn, pid), what="release_runs waiting for the fence's lock")
        writer.commit()
        release.join(20)
        assert done == [1]
        assert _seqs(conn, run_id) == [2, 3, 4]
        assert scalar(conn, "SELECT seq FROM runpool.event_seqs WHERE run_id = %s", run_id) == 4
