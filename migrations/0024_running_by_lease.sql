-- 0024_running_by_lease: the last two worker statements about given runs that said running as
-- `status = 'running'` say it as `lease_expires_at IS NOT NULL` (the same rows, by the
-- running_has_lease check), as the worker's own statements do since session 6 (see "How a
-- worker's statement says running" in runpool/queries.sql).
--
-- Why: naming the status lets a generic plan read the run through runs_running_tenant, whose
-- predicate it implies; that partial index keeps an entry for every run that ran since the last
-- vacuum, and statistics taken while few runs were running make scanning it whole look as cheap
-- as the primary key (an attack on session 6's change found both plans: every progress flush
-- and every resumed run's answered-wait check read all of those entries).
-- tests/test_worker_plans.py counts the index scans of both.
--
-- Unchanged otherwise: both bodies are 0009's and 0013's, with only that condition changed
-- (publish_progress also names the ids as an array, which the primary key serves).

-- publish_progress (0009).
CREATE OR REPLACE FUNCTION runpool.publish_progress(run_ids uuid[], attempts integer[],
                                                    payloads jsonb[], ended uuid[] DEFAULT '{}')
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
        WHERE r.id = ANY(publish_progress.run_ids) AND r.lease_expires_at IS NOT NULL
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

-- _wait (0013).
CREATE OR REPLACE FUNCTION runpool._wait(run_id uuid, attempt integer, seq integer, kind text,
                                         name text, children uuid[], timeout double precision,
                                         stay double precision DEFAULT 0)
RETURNS TABLE (state text, payload jsonb, until timestamptz, seconds_left double precision)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    w runpool.waits;
    signal_id bigint;
    strangers integer;
    known boolean;
BEGIN
    IF _wait.kind IS NULL OR _wait.kind NOT IN ('signal', 'sleep', 'join') THEN
        RAISE EXCEPTION 'runpool._wait: kind must be signal, sleep or join'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF _wait.seq IS NULL OR _wait.seq NOT BETWEEN 1 AND 100000 THEN
        RAISE EXCEPTION 'runpool._wait: a run may wait at most 100000 times'
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF _wait.kind = 'signal'
       AND (_wait.name IS NULL
            OR length(_wait.name) NOT BETWEEN 1 AND runpool.max_name_length()) THEN
        RAISE EXCEPTION 'runpool._wait: the signal name must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF _wait.timeout IS NOT NULL
       AND (_wait.timeout = 'NaN' OR _wait.timeout NOT BETWEEN 0 AND 315576000) THEN
        RAISE EXCEPTION 'runpool._wait: the timeout must be a number of seconds up to 10 years'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A wait answered in an earlier attempt (what every resumed run asks first) is read
    -- without locking anything: an answer never changes, and a lock would make the call a
    -- write transaction, with a commit to flush (a few ms each on a durable server).
    SELECT * INTO w FROM runpool.waits x WHERE x.run_id = _wait.run_id AND x.seq = _wait.seq;
    IF FOUND AND w.state NOT IN ('pending', 'cancelled')
       AND w.kind = _wait.kind AND w.name IS NOT DISTINCT FROM _wait.name
       AND w.children IS NOT DISTINCT FROM _wait.children THEN
        IF NOT EXISTS (SELECT 1 FROM runpool.runs r
                       WHERE r.id = _wait.run_id AND r.attempt = _wait.attempt
                         AND r.lease_expires_at IS NOT NULL) THEN
            RETURN QUERY SELECT 'lost'::text, NULL::jsonb, NULL::timestamptz, NULL::float8;
            RETURN;
        END IF;
        RETURN QUERY SELECT w.state, w.payload, w.until,
            greatest(extract(epoch FROM w.until - clock_timestamp()), 0)::float8;
        RETURN;
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = _wait.run_id FOR NO KEY UPDATE;
    IF NOT FOUND OR run.attempt <> _wait.attempt THEN
        RETURN QUERY SELECT 'lost'::text, NULL::jsonb, NULL::timestamptz, NULL::float8;
        RETURN;
    END IF;
    SELECT * INTO w FROM runpool.waits x WHERE x.run_id = run.id AND x.seq = _wait.seq;
    known := FOUND;
    IF run.status = 'waiting' AND known AND w.state = 'pending' THEN
        -- This very commit, repeated after its connection broke.
        RETURN QUERY SELECT 'waiting'::text, NULL::jsonb, w.until, NULL::float8;
        RETURN;
    END IF;
    IF run.status <> 'running' THEN
        RETURN QUERY SELECT 'lost'::text, NULL::jsonb, NULL::timestamptz, NULL::float8;
        RETURN;
    END IF;
    IF run.serial_key IS NOT NULL THEN
        -- A waiting run would have to keep its key (nothing else of the key may run), and the
        -- key's rules count only queued and running runs: refused rather than half kept.
        RAISE EXCEPTION 'runpool._wait: a run with a serial key cannot wait (serial key %)',
            run.serial_key USING ERRCODE = 'feature_not_supported';
    END IF;
    IF known THEN
        IF w.kind <> _wait.kind OR w.name IS DISTINCT FROM _wait.name
           OR w.children IS DISTINCT FROM _wait.children THEN
            RAISE EXCEPTION 'runpool._wait: wait % of run % was a % wait (%), now a % wait (%):'
                ' a handler must wait in the same order on every attempt',
                w.seq, run.id, w.kind, coalesce(w.name, w.children::text, w.until::text),
                _wait.kind, coalesce(_wait.name, _wait.children::text, _wait.timeout::text)
                USING ERRCODE = 'invalid_parameter_value';
        END IF;
        IF w.state = 'cancelled' THEN
            -- Left unanswered (cancelled while it waited, past its deadline, or timed out and
            -- failing the run), then retried (retry_run): the same wait goes on, timed afresh
            -- from now as the handler asks now (kept, its first deadline had often passed
            -- already: the retry timed out at once).
            UPDATE runpool.waits x SET state = 'pending', resolved_at = NULL, since = now(),
                until = now() + _wait.timeout * interval '1 second'
            WHERE x.run_id = run.id AND x.seq = w.seq
            RETURNING * INTO w;
        ELSIF w.state <> 'pending' THEN
            RETURN QUERY SELECT w.state, w.payload, w.until,
                greatest(extract(epoch FROM w.until - clock_timestamp()), 0)::float8;
            RETURN;
        END IF;
        -- Pending (or reopened) while running: the same wait goes on, with its first
        -- deadline.
    ELSE
        IF _wait.kind = 'join' THEN
            IF _wait.children IS NULL OR cardinality(_wait.children) NOT BETWEEN 1 AND 10000 THEN
                RAISE EXCEPTION 'runpool._wait: join between 1 and 10000 children'
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
            SELECT count(*) INTO strangers FROM unnest(_wait.children) AS c(id)
            WHERE NOT EXISTS (SELECT 1 FROM runpool.runs k
                              WHERE k.id = c.id AND k.parent_id = run.id);
            IF strangers > 0 THEN
                RAISE EXCEPTION 'runpool._wait: a run joins only its own children (spawned by'
                    ' it); % of the ids are not', strangers
                    USING ERRCODE = 'invalid_parameter_value';
            END IF;
        END IF;
        INSERT INTO runpool.waits AS x (run_id, seq, kind, name, children, attempt, until)
        VALUES (run.id, _wait.seq, _wait.kind, _wait.name, _wait.children, run.attempt,
                now() + _wait.timeout * interval '1 second')
        RETURNING * INTO w;
    END IF;

    IF w.kind = 'signal' THEN
        -- The oldest stored signal of this name is consumed by this wait, once.
        SELECT s.id INTO signal_id FROM runpool.signals s
        WHERE s.run_id = run.id AND s.name = w.name AND s.consumed_by IS NULL
        ORDER BY s.id LIMIT 1 FOR UPDATE;
        IF signal_id IS NOT NULL THEN
            UPDATE runpool.signals s SET consumed_by = w.seq, consumed_at = now()
            WHERE s.id = signal_id;
            UPDATE runpool.waits x SET state = 'signalled', resolved_at = now(),
                payload = (SELECT s.payload FROM runpool.signals s WHERE s.id = signal_id)
            WHERE x.run_id = run.id AND x.seq = w.seq
            RETURNING * INTO w;
        END IF;
    ELSIF w.kind = 'sleep' THEN
        IF w.until <= now() + coalesce(_wait.stay, 0) * interval '1 second' THEN
            -- Over, or short enough to sleep in the slot: resolved now; the worker sleeps
            -- what is left of it (again after a crash: until is kept).
            UPDATE runpool.waits x SET state = 'woke', resolved_at = now()
            WHERE x.run_id = run.id AND x.seq = w.seq
            RETURNING * INTO w;
        END IF;
    ELSIF NOT EXISTS (SELECT 1 FROM runpool.runs k
                      WHERE k.id = ANY(w.children)
                        AND k.status NOT IN ('succeeded', 'failed', 'cancelled')) THEN
        UPDATE runpool.waits x SET state = 'joined', resolved_at = now()
        WHERE x.run_id = run.id AND x.seq = w.seq
        RETURNING * INTO w;
    END IF;
    IF w.state = 'pending' AND w.until <= now() THEN
        UPDATE runpool.waits x SET state = 'timed_out', resolved_at = now()
        WHERE x.run_id = run.id AND x.seq = w.seq
        RETURNING * INTO w;
    END IF;
    IF w.state <> 'pending' THEN
        RETURN QUERY SELECT w.state, w.payload, w.until,
                greatest(extract(epoch FROM w.until - clock_timestamp()), 0)::float8;
        RETURN;
    END IF;

    IF run.cancel_requested_at IS NOT NULL THEN
        -- Asked to stop while it ran: it does not start waiting (nothing would end the wait
        -- but its signal); it ends cancelled now, as a waiting run would.
        UPDATE runpool.runs r SET status = 'cancelled', finished_at = now(),
            lease_expires_at = NULL
        WHERE r.id = run.id;
        UPDATE runpool.waits x SET state = 'cancelled', resolved_at = now()
        WHERE x.run_id = run.id AND x.seq = w.seq;
        INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
        VALUES (run.id, 'cancelled', run.attempt, run.worker_id,
                jsonb_build_object('reason', run.cancel_reason));
        RETURN QUERY SELECT 'cancelled'::text, NULL::jsonb, w.until, NULL::float8;
        RETURN;
    END IF;
    UPDATE runpool.runs r SET
        status = 'waiting', lease_expires_at = NULL, attempt_offset = r.attempt_offset + 1,
        deferred = false
    WHERE r.id = run.id;
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
    VALUES (run.id, 'waiting', run.attempt, run.worker_id, jsonb_strip_nulls(jsonb_build_object(
        'kind', w.kind, 'seq', w.seq, 'name', w.name, 'until', w.until,
        'children', to_jsonb(w.children))));
    RETURN QUERY SELECT 'waiting'::text, NULL::jsonb, w.until, NULL::float8;
END
$$;
