"""The batch forms of the checkpoint writes (checkpoints.store): many runs' writes of one kind
in one statement, for a worker's group commit (runpool/commits.py)."""

from __future__ import annotations

from typing import Final

__all__ = ["BATCH_FINISH", "BATCH_INTENT", "BATCH_MESSAGE"]

# -- Batches: many runs' writes of one kind in one statement (a worker's group commit, one
# write per run). The writes come as one JSON array (Statement.batch_params), so a batch of 20 costs
# one statement's parse, bind and executor start on the server and one execute in psycopg,
# not 20. Each write is fenced as its one-statement form (store.py) is (the run row share-locked,
# in id order, only while its attempt holds it); each returns its run id and what its single
# statement returns; a write refused finds no row and is answered as its single form's is.
# A run row another transaction holds (a tenant's signal_run left open) is skipped, not
# waited for: that write returns no row and its sender repeats it alone (only it waits).
# (Static text joined below; nothing in it is dynamic.)
BATCH_FENCE: Final = """
WITH fence AS (
    SELECT r.id, r.event_seq, w.run_id, w.attempt, w.role, w.call_id, w.name, w.status,
           -- A JSON null in the array (a tool returning None) is SQL NULL in the record:
           -- stored as jsonb 'null', as the single statement stores it.
           coalesce(w.content, 'null') AS content, coalesce(w.arguments, 'null') AS arguments,
           coalesce(w.result, 'null') AS result
    FROM jsonb_to_recordset(%(rows)s) AS w(run_id uuid, attempt integer, role text,
                                          content jsonb, call_id text, name text,
                                          arguments jsonb, status text, result jsonb)
    -- Running, said as store.HOLDS says it (no plan through a partial index of running runs).
    JOIN runpool.runs r ON r.id = w.run_id AND r.attempt = w.attempt
                       AND r.lease_expires_at IS NOT NULL
    -- The ids as an array too, so the plan reads the runs through their primary key: a
    -- generic plan takes the batch for 100 rows and would rather hash it against all of
    -- `runs` up to a table of about 20,000 (tests/test_worker_plans.py).
    -- (Only the ids are read out: jsonb_array_elements would copy every write's content.)
    WHERE r.id = ANY(ARRAY(SELECT i.run_id FROM jsonb_to_recordset(%(rows)s) AS i(run_id uuid)))
    ORDER BY r.id
    FOR SHARE OF r SKIP LOCKED
)"""
# Each fenced write's seqs from its run's counter row (EVENT, for many runs), and its run's
# doorbell rung here only if %(ring)s: a loaded worker rings the runs after this commits, in
# a transaction of its own (runpool.doorbells: a NOTIFY makes every commit wait for the one
# before it, flush and all); one that is not rings here, at its commit, at no round trip more.
BATCH_EVENT: Final = """,
event AS (
    INSERT INTO runpool.event_seqs AS s (run_id, seq)
    SELECT fence.id, fence.event_seq + %(events)s FROM fence ORDER BY fence.id
    ON CONFLICT ON CONSTRAINT event_seqs_pkey DO UPDATE SET seq = s.seq + %(events)s
    RETURNING s.run_id, s.seq, CASE WHEN %(ring)s THEN runpool._ring(s.run_id) END
)"""
# INSERT_MESSAGE for many runs: each run's message at its next sequence number.
BATCH_MESSAGE: Final = BATCH_FENCE + BATCH_EVENT + """
INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id, event_seq)
SELECT f.id,
       coalesce((SELECT max(m.seq) FROM runpool.messages m WHERE m.run_id = f.id), 0) + 1,
       f.role, f.content, f.attempt, NULL, event.seq
FROM fence f JOIN event ON event.run_id = f.id
RETURNING run_id, seq
"""
# INSERT_INTENT for many runs.
BATCH_INTENT: Final = BATCH_FENCE + BATCH_EVENT + """
INSERT INTO runpool.tool_calls AS t (run_id, call_id, name, arguments, status, attempt,
                                     started_seq)
SELECT f.id, f.call_id, f.name, f.arguments, 'started', f.attempt, event.seq
FROM fence f JOIN event ON event.run_id = f.id
ON CONFLICT (run_id, call_id) DO UPDATE
    SET attempt = excluded.attempt, started_at = now(), executions = t.executions + 1,
        started_seq = excluded.started_seq, finished_seq = NULL
    WHERE t.status = 'started' AND t.attempt < excluded.attempt
      AND t.name = excluded.name AND t.arguments = excluded.arguments
RETURNING run_id, executions
"""
# FINISH_CALL for many runs: each call's outcome and its tool message.
BATCH_FINISH: Final = BATCH_FENCE + BATCH_EVENT + """,
finished AS (
    UPDATE runpool.tool_calls t SET status = f.status, result = f.result, finished_at = now(),
        finished_seq = event.seq - 1
    FROM fence f JOIN event ON event.run_id = f.id
    WHERE t.run_id = f.id AND t.call_id = f.call_id AND t.status = 'started'
    RETURNING t.run_id
)
INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id, event_seq)
SELECT f.id,
       coalesce((SELECT max(m.seq) FROM runpool.messages m WHERE m.run_id = f.id), 0) + 1,
       f.role, f.content, f.attempt, f.call_id, event.seq
FROM finished JOIN fence f ON f.id = finished.run_id JOIN event ON event.run_id = f.id
RETURNING run_id, seq
"""
