-- 0015_ops: operations over months (issue 18): retention (purge_finished and the pools'
-- background purger), autovacuum settings for a queue, and the dead-letter alert outbox.

-- == Retention ===================================================================================

-- Finished runs by end time, oldest first: what a purge batch reads. finished_at is set exactly
-- when a run is terminal (finished_when_terminal), so "finished_at IS NOT NULL" is "terminal"
-- whatever statuses later migrations add, and a purge's "finished_at < x" implies it.
CREATE INDEX runs_finished ON runpool.runs (finished_at) WHERE finished_at IS NOT NULL;

-- Which pool does a cluster-wide chore, and when it is due next. A pool takes its turn by
-- locking the chore's row (FOR UPDATE SKIP LOCKED): only roles that may UPDATE this table can
-- hold that lock (runpool_api cannot), where any login could hold an advisory lock key.
CREATE TABLE runpool.maintenance (
    task       text PRIMARY KEY,
    next_at    timestamptz NOT NULL DEFAULT now(),
    last_at    timestamptz,
    -- What its last turn did (runs removed, for the purge).
    last_count bigint
);
INSERT INTO runpool.maintenance (task) VALUES ('purge');

-- One batch of the purge: at most batch_size runs that ended before now() - older_than, oldest
-- first, with every row of theirs (messages and tool calls go by their foreign keys' cascade;
-- events, status events, progress, the checkpoints' event counters (event_seqs), durable waits,
-- signals and join checks have none, so they are deleted here). SKIP LOCKED: a run
-- someone holds (a retry_run, a reader's FOR SHARE) is left for a later batch, so a purge never
-- waits for a lock, and the rows it locks are finished runs no claim ever looks at. A row that
-- stopped being finished under the lock (retry_run won) is re-checked and left alone.
CREATE FUNCTION runpool._purge_batch(older_than interval, batch_size integer) RETURNS bigint
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
    WITH doomed AS MATERIALIZED (
        SELECT r.id FROM runpool.runs r
        WHERE r.finished_at < now() - _purge_batch.older_than
          AND r.status IN ('succeeded', 'failed', 'cancelled')
          -- A parent stays while a child of its is unfinished (the child may still report
          -- to it), and a child while its parent is unfinished (the parent may still join
          -- it and read its result): a family goes once all of it has ended.
          AND NOT EXISTS (SELECT 1 FROM runpool.runs k
                          WHERE k.parent_id = r.id AND k.finished_at IS NULL)
          AND NOT EXISTS (SELECT 1 FROM runpool.runs p
                          WHERE p.id = r.parent_id AND p.finished_at IS NULL)
        ORDER BY r.finished_at
        LIMIT _purge_batch.batch_size
        FOR UPDATE SKIP LOCKED
    ), events AS (
        DELETE FROM runpool.run_events e USING doomed d WHERE e.run_id = d.id
    ), statuses AS (
        DELETE FROM runpool.status_events s USING doomed d WHERE s.run_id = d.id
    ), progress AS (
        DELETE FROM runpool.progress p USING doomed d WHERE p.run_id = d.id
    ), seqs AS (
        DELETE FROM runpool.event_seqs q USING doomed d WHERE q.run_id = d.id
    ), waits AS (
        DELETE FROM runpool.waits w USING doomed d WHERE w.run_id = d.id
    ), signals AS (
        DELETE FROM runpool.signals g USING doomed d WHERE g.run_id = d.id
    ), join_checks AS (
        DELETE FROM runpool.join_checks j USING doomed d WHERE j.parent_id = d.id
    ), gone AS (
        DELETE FROM runpool.runs r USING doomed d WHERE r.id = d.id RETURNING 1
    )
    SELECT count(*) FROM gone
$$;

-- The SQL API: delete every run that ended before now() - older_than with its events, messages
-- and tool calls, batch_size runs at a time; returns the number of runs removed. One call is one
-- transaction (a function cannot commit): for a backlog of millions, call it with a shorter
-- older_than first, or let the pools' purger do it (each of its batches commits on its own).
CREATE FUNCTION runpool.purge_finished(older_than interval, batch_size integer DEFAULT 10000)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    total bigint := 0;
    removed bigint;
BEGIN
    IF older_than IS NULL OR older_than < interval '0' THEN
        RAISE EXCEPTION 'runpool.purge_finished: older_than must be a non-negative interval, got %',
            coalesce(older_than::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF batch_size IS NULL OR batch_size NOT BETWEEN 1 AND 1000000 THEN
        RAISE EXCEPTION 'runpool.purge_finished: batch_size must be between 1 and 1000000, got %',
            coalesce(batch_size::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    LOOP
        removed := runpool._purge_batch(older_than, batch_size);
        total := total + removed;
        EXIT WHEN removed < batch_size;
    END LOOP;
    RETURN total;
END
$$;

-- A pool's turn at the background purge: NULL when another pool holds the turn or it is not
-- due; else one batch (committed by the caller), and once the backlog is gone, the rows of
-- workers and alerts past retention too, and the next turn `every` from now. lock_timeout: the
-- purge waits for nobody (a foreign key's cascade locking a row someone holds, say).
CREATE FUNCTION runpool._purge_turn(older_than interval, batch_size integer, every interval)
RETURNS bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET lock_timeout = '2s'
AS $$
DECLARE
    removed bigint;
BEGIN
    PERFORM 1 FROM runpool.maintenance m
    WHERE m.task = 'purge' AND m.next_at <= now() FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    removed := runpool._purge_batch(older_than, batch_size);
    IF removed < batch_size THEN
        -- A live worker is seen every heartbeat (a third of its lease); one unseen for an
        -- hour is gone, whatever a short retention says.
        DELETE FROM runpool.workers w
        WHERE coalesce(w.stopped_at, w.last_seen_at)
              < now() - greatest(older_than, interval '1 hour');
        DELETE FROM runpool.alerts a WHERE a.created_at < now() - older_than;
    END IF;
    UPDATE runpool.maintenance m
    SET next_at = CASE WHEN removed < batch_size THEN now() + every ELSE now() END,
        last_at = now(), last_count = removed
    WHERE m.task = 'purge';
    RETURN removed;
END
$$;

-- == Autovacuum for a queue ======================================================================
-- The defaults vacuum a table once 20 % of it is dead (scale factor 0.2). runs holds every run
-- of the retention window (millions) and each run's row is rewritten several times (claim,
-- heartbeats, a seq bump per message and tool call, the outcome): at 0.2 a million-row table
-- carries 200,000 dead tuples before vacuum starts, and the claim's index scans wade through
-- them (the 2-3 ms -> 180 ms PlanetScale measured). 1 % (plus 1,000) keeps the dead tail short;
-- a frequent vacuum stays cheap because the visibility map lets it skip the pages of old
-- finished runs. The cost limit is raised so vacuum of the hottest table is not throttled to
-- the default 200 pages a round while the queue keeps churning.
ALTER TABLE runpool.runs SET (
    autovacuum_vacuum_scale_factor = 0.01,
    autovacuum_vacuum_threshold = 1000,
    autovacuum_analyze_scale_factor = 0.02,
    autovacuum_vacuum_cost_limit = 2000
);
-- Append-only tables the purge deletes from in batches: vacuum once 5 % is dead, so space freed
-- by a purge is reused by the next inserts instead of growing the file (the plateau).
ALTER TABLE runpool.messages SET (autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE runpool.tool_calls SET (autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE runpool.run_events SET (autovacuum_vacuum_scale_factor = 0.05);
ALTER TABLE runpool.status_events SET (autovacuum_vacuum_scale_factor = 0.05);

-- == Dead-letter alerts ==========================================================================

-- The outbox: one row per run entering 'failed', written by a trigger in the transaction that
-- failed it, whatever the path (an outcome, the reaper past max_attempts, a deadline, an
-- unknown handler...). Pools with RUNPOOL_ALERT_WEBHOOK deliver them, at least once; the id is
-- the alert's identity across redeliveries. Rows go with the retention purge.
CREATE TABLE runpool.alerts (
    id           uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    run_id       uuid NOT NULL,
    tenant       text NOT NULL,
    handler      text NOT NULL,
    reason       text,
    message      text,
    -- Attempts the run used (against its max_attempts).
    attempts     integer NOT NULL,
    created_at   timestamptz NOT NULL DEFAULT now(),
    -- When a sender may next try it: a sender taking it pushes this past its request's
    -- timeout (so no other sender takes it meanwhile), a failed try past its backoff.
    next_at      timestamptz NOT NULL DEFAULT now(),
    tries        integer NOT NULL DEFAULT 0,
    delivered_at timestamptz,
    last_error   text
);
-- Undelivered alerts by due time: what a sender reads every second; delivered rows leave it.
CREATE INDEX alerts_due ON runpool.alerts (next_at) WHERE delivered_at IS NULL;

CREATE FUNCTION runpool._alert_on_failure() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    INSERT INTO runpool.alerts (run_id, tenant, handler, reason, message, attempts)
    VALUES (NEW.id, NEW.tenant, NEW.handler,
            left(CASE WHEN jsonb_typeof(NEW.error) = 'object' THEN NEW.error ->> 'reason' END,
                 200),
            left(CASE WHEN jsonb_typeof(NEW.error) = 'object' THEN NEW.error ->> 'message' END,
                 2000),
            runpool.attempts_used(NEW.attempt, NEW.attempt_offset));
    RETURN NULL;
END
$$;

-- Row triggers whose WHEN is false cost a comparison: an outcome batch of succeeded runs pays
-- nothing more.
CREATE TRIGGER runs_failed_alert AFTER UPDATE OF status ON runpool.runs
    FOR EACH ROW WHEN (NEW.status = 'failed' AND OLD.status IS DISTINCT FROM 'failed')
    EXECUTE FUNCTION runpool._alert_on_failure();
CREATE TRIGGER runs_failed_alert_insert AFTER INSERT ON runpool.runs
    FOR EACH ROW WHEN (NEW.status = 'failed')
    EXECUTE FUNCTION runpool._alert_on_failure();

-- == Rights ======================================================================================

REVOKE ALL ON FUNCTION
    runpool._purge_batch(interval, integer),
    runpool.purge_finished(interval, integer),
    runpool._purge_turn(interval, integer, interval),
    runpool._alert_on_failure()
FROM PUBLIC;
-- Purging is the pools' (and an operator's, through the worker role) business: runpool_api
-- may read and call the run API, not delete history.
GRANT EXECUTE ON FUNCTION
    runpool.purge_finished(interval, integer),
    runpool._purge_turn(interval, integer, interval)
TO runpool_worker;

GRANT SELECT ON runpool.maintenance, runpool.alerts TO runpool_api;
-- The worker role updates alerts as it delivers them; rows come only from the trigger.
GRANT SELECT, UPDATE ON runpool.maintenance, runpool.alerts TO runpool_worker;
