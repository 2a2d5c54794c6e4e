-- 0009_live: live runs. Every stored event of a run (status change, message, tool call start
-- and commit) gets a per-run, strictly increasing seq in commit order, and rings the run's own
-- doorbell; progress events (not stored) live in an unlogged table, latest value per run.
--
-- Why a per-run counter held under lock until commit: it serialises every writer of one run, so
-- the order of seq is the order of commits (a global sequence is not: a cancel_run and a
-- checkpoint can commit out of the order they drew their numbers in, and a resuming follower
-- would skip one). The counter is the run row's event_seq while the run wrote no checkpoint
-- (a status change takes its seq in the same row update: nothing more to write), and a row of
-- its own in event_seqs from its first checkpoint on: a checkpoint write must not UPDATE the
-- run row, whose share lock (the write's fence) is all it took before. An update of the run
-- row by every write made a caller's cancel_run in REPEATABLE READ or SERIALIZABLE fail
-- ("could not serialize access due to concurrent update") whenever it met a write in flight
-- (20 of 40 against a real pool's agent runs; 0 of 40 before), and rewrote the widest row of
-- the schema once per message.
-- Why triggers: every path that changes a run (claim, outcomes, reap, release, cancel, retry,
-- resolve_tool_call, checkpoints) is covered without redefining any of those statements.

-- The run's last event seq. 1 is its 'queued' status at enqueue (not stored as a row: read
-- from created_at), so an enqueue writes nothing more than before. Added with the default 2,
-- which the runs already there take without a rewrite (a constant default is kept in the
-- catalog): a run from before this migration has its status of now as event 2 (below). An
-- UPDATE of every run ever finished instead would make this migration's hold on runs (its
-- ALTER locks the table until commit: every claim, heartbeat and outcome waits) grow with the
-- history: measured 6 s more per 500,000 finished runs.
ALTER TABLE runpool.runs ADD COLUMN event_seq bigint NOT NULL DEFAULT 2;
ALTER TABLE runpool.runs ALTER COLUMN event_seq SET DEFAULT 1;
ALTER TABLE runpool.messages ADD COLUMN event_seq bigint;
ALTER TABLE runpool.tool_calls ADD COLUMN started_seq bigint, ADD COLUMN finished_seq bigint;
-- A follower reads the events after its seq: an index range, not the whole conversation.
CREATE INDEX messages_events ON runpool.messages (run_id, event_seq);
CREATE INDEX tool_calls_events ON runpool.tool_calls (run_id, (coalesce(finished_seq, started_seq)));

-- The event counter of runs that wrote a checkpoint (see above); no row: runs.event_seq is it.
CREATE TABLE runpool.event_seqs (
    run_id uuid PRIMARY KEY,
    seq    bigint NOT NULL
);

-- Every status change of every run, in order (run_events keeps its own, richer journal).
CREATE TABLE runpool.status_events (
    run_id  uuid NOT NULL,
    seq     bigint NOT NULL,
    at      timestamptz NOT NULL DEFAULT now(),
    status  text NOT NULL,
    attempt integer NOT NULL,
    reason  text,
    PRIMARY KEY (run_id, seq)
);

-- Progress: ephemeral, the latest value per run (coalesced), lost on a server crash by design.
CREATE UNLOGGED TABLE runpool.progress (
    run_id  uuid PRIMARY KEY,
    attempt integer NOT NULL,
    version bigint NOT NULL DEFAULT 1,
    data    jsonb NOT NULL,
    at      timestamptz NOT NULL DEFAULT now()
);

-- Runs that existed before this migration: their current status becomes their event 2,
-- except for runs still waiting for their first attempt (only their 'queued' of seq 1: the
-- backlog, rewritten back to 1).
INSERT INTO runpool.status_events (run_id, seq, at, status, attempt)
SELECT id, 2, coalesce(finished_at, started_at, created_at), status, attempt
FROM runpool.runs WHERE status <> 'queued' OR attempt > 0;
UPDATE runpool.runs SET event_seq = 1 WHERE status = 'queued' AND attempt = 0;

-- Ring a run's doorbell: a channel of the run's own (runpool_run_<id as 32 hex digits>, empty
-- payload), so a follower hears only its run, not every run's traffic. Not while the server's
-- notification queue is over half full (runpool.notify_queue_limit, a fraction, in a session
-- that wants another bound): a session that LISTENs and does not read on (idle in a
-- transaction, or not reading its socket) holds the queue back, and once it is full every
-- NOTIFY fails its transaction; no checkpoint write or outcome may fail for a reader's sake
-- (any login that may connect can LISTEN). Followers then see new events at their next poll.
-- Measured: 44 bytes of queue per notification held; 8 GB is ~190 million of them.
CREATE FUNCTION runpool._ring(run_id uuid) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    IF pg_notification_queue_usage()
       < coalesce(nullif(current_setting('runpool.notify_queue_limit', true), '')::float8, 0.5)
    THEN
        PERFORM pg_notify('runpool_run_' || replace(_ring.run_id::text, '-', ''), '');
    END IF;
END
$$;

-- Take the next event seq of a run for a checkpoint write (its counter row locked until
-- commit) and ring its doorbell. The run row is share-locked, as the write's fence does anyway: no status change (which locks it
-- exclusively) comes in between, so the first write starts from the run's last seq.
CREATE FUNCTION runpool._next_event_seq(run_id uuid) RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    base bigint;
    seq bigint;
BEGIN
    SELECT r.event_seq INTO base FROM runpool.runs r WHERE r.id = _next_event_seq.run_id
    FOR SHARE;
    -- No such run: 1 + 1, and the write's own foreign key says what is wrong.
    INSERT INTO runpool.event_seqs AS s (run_id, seq)
    VALUES (_next_event_seq.run_id, coalesce(base, 1) + 1)
    ON CONFLICT ON CONSTRAINT event_seqs_pkey DO UPDATE SET seq = s.seq + 1
    RETURNING s.seq INTO seq;
    PERFORM runpool._ring(_next_event_seq.run_id);
    RETURN seq;
END
$$;

-- A status change: its seq is taken in the same row update (no second write of the row), or,
-- once the run wrote a checkpoint, from its counter row (kept equal), and its event stored. Only a terminal status rings the doorbell: claims and retries of a
-- throughput-bound pool stay notification-free (W1); a follower sees them with the next
-- message or tool call, or at its next poll.
CREATE FUNCTION runpool._run_status_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    UPDATE runpool.event_seqs s SET seq = s.seq + 1 WHERE s.run_id = NEW.id
    RETURNING s.seq INTO NEW.event_seq;
    IF NOT FOUND THEN
        NEW.event_seq := OLD.event_seq + 1;
    END IF;
    INSERT INTO runpool.status_events (run_id, seq, status, attempt, reason)
    VALUES (NEW.id, NEW.event_seq, NEW.status, NEW.attempt, CASE
        WHEN NEW.status = 'cancelled' THEN coalesce(NEW.cancel_reason, NEW.error->>'reason')
        WHEN NEW.status = 'failed' THEN NEW.error->>'reason'
        WHEN NEW.status = 'queued' AND OLD.status = 'running' THEN CASE
            WHEN NEW.attempt_offset > OLD.attempt_offset THEN 'released'
            WHEN NEW.deferred OR NEW.error IS DISTINCT FROM OLD.error
                THEN coalesce(NEW.error->>'reason', 'retry')
            ELSE 'lease_expired' END
        WHEN NEW.status = 'queued' THEN 'retried'
    END);
    IF NEW.status IN ('succeeded', 'failed', 'cancelled') THEN
        PERFORM runpool._ring(NEW.id);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER run_status_changed
BEFORE UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (OLD.status IS DISTINCT FROM NEW.status)
EXECUTE FUNCTION runpool._run_status_changed();

-- A message written (or rewritten by resolve_tool_call): its seq.
CREATE FUNCTION runpool._message_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    NEW.event_seq := runpool._next_event_seq(NEW.run_id);
    RETURN NEW;
END
$$;

CREATE TRIGGER message_event
BEFORE INSERT OR UPDATE OF content ON runpool.messages
FOR EACH ROW
EXECUTE FUNCTION runpool._message_event();

-- A tool call started (or started again after an interruption) or closed: its seq.
CREATE FUNCTION runpool._tool_call_event() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    IF NEW.status = 'started' THEN
        NEW.started_seq := runpool._next_event_seq(NEW.run_id);
        NEW.finished_seq := NULL;
    ELSE
        NEW.finished_seq := runpool._next_event_seq(NEW.run_id);
    END IF;
    RETURN NEW;
END
$$;

CREATE TRIGGER tool_call_event
BEFORE INSERT ON runpool.tool_calls
FOR EACH ROW
EXECUTE FUNCTION runpool._tool_call_event();

CREATE TRIGGER tool_call_changed
BEFORE UPDATE ON runpool.tool_calls
FOR EACH ROW
WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.executions IS DISTINCT FROM NEW.executions
      OR OLD.result IS DISTINCT FROM NEW.result)
EXECUTE FUNCTION runpool._tool_call_event();

-- Publish the latest progress of runs this worker holds (fenced by attempt: a zombie's is
-- dropped), one statement per flush, ringing each run's doorbell; and forget the progress of
-- runs that ended. Returns how many were published.
CREATE FUNCTION runpool.publish_progress(run_ids uuid[], attempts integer[], payloads jsonb[],
                                         ended uuid[] DEFAULT '{}')
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    published integer;
BEGIN
    DELETE FROM runpool.progress p WHERE p.run_id = ANY(publish_progress.ended);
    WITH given AS (
        SELECT * FROM unnest(publish_progress.run_ids, publish_progress.attempts,
                             publish_progress.payloads) AS g(run_id, attempt, payload)
    ),
    held AS (
        SELECT g.run_id, g.attempt, g.payload FROM given g
        JOIN runpool.runs r ON r.id = g.run_id AND r.attempt = g.attempt
        WHERE r.status = 'running'
    ),
    up AS (
        INSERT INTO runpool.progress AS p (run_id, attempt, data)
        SELECT h.run_id, h.attempt, h.payload FROM held h
        ON CONFLICT (run_id) DO UPDATE
            SET attempt = excluded.attempt, data = excluded.data, version = p.version + 1,
                at = now()
        RETURNING p.run_id
    )
    SELECT count(runpool._ring(up.run_id)) INTO published FROM up;
    RETURN published;
END
$$;

REVOKE ALL ON FUNCTION
    runpool._ring(uuid),
    runpool._next_event_seq(uuid),
    runpool._run_status_changed(),
    runpool._message_event(),
    runpool._tool_call_event(),
    runpool.publish_progress(uuid[], integer[], jsonb[], uuid[])
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool.publish_progress(uuid[], integer[], jsonb[], uuid[])
TO runpool_worker;
GRANT SELECT ON runpool.status_events, runpool.progress, runpool.event_seqs
TO runpool_api, runpool_worker;
