-- 0013_waits: durable waits and child runs (issue 15). A handler's wait_for / sleep / join
-- commits the wait and ends its attempt without consuming it: the run becomes 'waiting' (no
-- lease, no slot, not counted against its tenant's quota) until a signal, its time or its
-- children's ends queue it again; the handler then runs from the top, its history comes back
-- from checkpoints, and the wait returns what resolved it. Child runs (spawn) are linked to
-- their parent by runs.parent_id.

-- 'waiting' joins the statuses. A waiting run has no lease (running_has_lease says so).
ALTER TABLE runpool.runs DROP CONSTRAINT status_known;
ALTER TABLE runpool.runs ADD CONSTRAINT status_known
    CHECK (status IN ('queued', 'running', 'waiting', 'succeeded', 'failed', 'cancelled'));
-- The run that spawned this one, and the call id it spawned it under (one child per call id).
-- No foreign key: finished runs are purged independently of one another.
ALTER TABLE runpool.runs ADD COLUMN parent_id uuid;
ALTER TABLE runpool.runs ADD COLUMN spawn_call_id text
    CONSTRAINT spawn_call_id_length CHECK (length(spawn_call_id) BETWEEN 1 AND 200);
ALTER TABLE runpool.runs ADD CONSTRAINT spawned_has_parent
    CHECK ((parent_id IS NULL) = (spawn_call_id IS NULL));
-- A parent's children (the cancel cascade, join's checks); unique: a spawn repeated after a
-- crash finds its child instead of making a second one.
CREATE UNIQUE INDEX runs_children ON runpool.runs (parent_id, spawn_call_id)
    WHERE parent_id IS NOT NULL;

-- One row per wait of a run, numbered in the order the handler waits (a handler waits in the
-- same order on every attempt, as it makes the same tool calls): the wait that suspended a run
-- and, once resolved, what resolved it, which the same wait reads again after any number of
-- later crashes (a consumed signal is never consumed twice).
CREATE TABLE runpool.waits (
    run_id      uuid NOT NULL,
    seq         integer NOT NULL CONSTRAINT wait_seq_range CHECK (seq BETWEEN 1 AND 100000),
    kind        text NOT NULL CONSTRAINT wait_kind CHECK (kind IN ('signal', 'sleep', 'join')),
    -- The signal waited for (kind 'signal').
    name        text CONSTRAINT wait_name_length CHECK (length(name) BETWEEN 1 AND 200),
    -- The children joined (kind 'join').
    children    uuid[],
    attempt     integer NOT NULL,
    since       timestamptz NOT NULL DEFAULT now(),
    -- When the wait times out (signal, join) or the sleep ends; NULL: never.
    until       timestamptz,
    -- 'cancelled': the run ended while it waited, cancelled or past its deadline (a retry_run
    -- waits again).
    state       text NOT NULL DEFAULT 'pending'
        CONSTRAINT wait_state CHECK (state IN ('pending', 'signalled', 'timed_out', 'woke',
                                               'joined', 'cancelled')),
    -- The consumed signal's payload (state 'signalled').
    payload     jsonb,
    resolved_at timestamptz,
    PRIMARY KEY (run_id, seq),
    CONSTRAINT wait_resolved CHECK ((state = 'pending') = (resolved_at IS NULL))
);
-- A run's pending wait (at most one: a run waits for one thing at a time).
CREATE UNIQUE INDEX waits_pending ON runpool.waits (run_id) WHERE state = 'pending';
-- Waiting runs that have a deadline (0012), for the deadline sweep (queries.sql
-- expire_deadlines), beside 0012's index of queued ones.
CREATE INDEX runs_deadline_waiting ON runpool.runs (deadline)
    WHERE deadline IS NOT NULL AND status = 'waiting';
-- Pending waits by the time they time out or wake. Only due ones are ever read (queries.sql
-- wake_due): 10,000 runs waiting cost the claim one index probe.
CREATE INDEX waits_due ON runpool.waits (until) WHERE state = 'pending' AND until IS NOT NULL;

-- Signals sent to runs, kept until a wait of their name consumes them (oldest first).
CREATE TABLE runpool.signals (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      uuid NOT NULL,
    name        text NOT NULL CONSTRAINT signal_name_length CHECK (length(name) BETWEEN 1 AND 200),
    payload     jsonb NOT NULL,
    sent_at     timestamptz NOT NULL DEFAULT now(),
    -- The wait (runpool.waits seq) that consumed it.
    consumed_by integer,
    consumed_at timestamptz,
    CONSTRAINT signal_consumed CHECK ((consumed_by IS NULL) = (consumed_at IS NULL))
);
-- A run's signals not consumed yet, by name, in arrival order.
CREATE INDEX signals_stored ON runpool.signals (run_id, name, id) WHERE consumed_by IS NULL;
-- A wait consumes one signal, and a signal is consumed by one wait: the database says so.
CREATE UNIQUE INDEX signals_consumed ON runpool.signals (run_id, consumed_by)
    WHERE consumed_by IS NOT NULL;

-- Signals a run may hold unconsumed: a sender in a loop fills only this run's row budget.
CREATE FUNCTION runpool.max_stored_signals() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 1000;

-- Queue waiting runs again (the one rule of a resume, for signals, timeouts, sleeps and
-- children): claimable now (unless their tenant is paused), keeping their rank: work already
-- under way goes before new arrivals of its priority. Rings the doorbell.
CREATE FUNCTION runpool._resume(run_ids uuid[], why text) RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    resumed integer;
BEGIN
    WITH woken AS (
        UPDATE runpool.runs r SET
            status = 'queued', available_at = now(), deferred = false, held = false,
            paused = EXISTS (SELECT 1 FROM runpool.tenants t
                             WHERE t.tenant = r.tenant AND t.max_running = 0)
        WHERE r.id = ANY(_resume.run_ids) AND r.status = 'waiting'
        RETURNING r.id, r.attempt
    ),
    events AS (
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        SELECT id, 'resumed', attempt, jsonb_build_object('by', _resume.why) FROM woken
    )
    SELECT count(*) INTO resumed FROM woken;
    IF resumed > 0 THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN resumed;
END
$$;

-- A handler's wait number `seq` (see runpool.waits): answered from its row if it was resolved
-- in an earlier attempt; else resolved now if it can be (a stored signal, an ended sleep or
-- timeout, children all ended, or a sleep shorter than `stay` seconds, which the worker sleeps
-- in the slot); else committed: the run becomes 'waiting', its attempt ends without counting
-- against max_attempts (attempt_offset, see runpool.attempts_used), or 'cancelled' for a run
-- whose cancel was requested (it ends cancelled instead). Fenced by the attempt:
-- state 'lost' when it no longer holds the run ('waiting' again for a repeat of this very
-- commit whose answer was lost with its connection). seconds_left: of a sleep to sleep in the
-- slot (database clock).
CREATE FUNCTION runpool._wait(run_id uuid, attempt integer, seq integer, kind text, name text,
                              children uuid[], timeout double precision,
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
                         AND r.status = 'running') THEN
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

-- Spawn a child of a running run: the run `runpool.enqueue` makes, in the parent's tenant and
-- trace (`traceparent`, else the parent's), linked by parent_id. Idempotent per (parent,
-- call_id): a repeat (a crash right after spawning, a resumed handler) answers the first
-- child. Fenced by the parent's attempt: NULL when it no longer holds the run. A parent being
-- cancelled spawns nothing (its cancel cascade must not miss a child).
CREATE FUNCTION runpool._spawn(parent uuid, attempt integer, call_id text, handler text,
                               input jsonb DEFAULT '{}', priority integer DEFAULT 0,
                               run_at timestamptz DEFAULT NULL,
                               max_attempts integer DEFAULT NULL,
                               traceparent text DEFAULT NULL,
                               timeout interval DEFAULT NULL,
                               deadline timestamptz DEFAULT NULL,
                               budget jsonb DEFAULT NULL)
RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    child uuid;
BEGIN
    IF _spawn.call_id IS NULL
       OR length(_spawn.call_id) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool._spawn: call_id must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = _spawn.parent FOR NO KEY UPDATE;
    IF NOT FOUND OR run.attempt <> _spawn.attempt OR run.status <> 'running' THEN
        RETURN NULL;
    END IF;
    SELECT k.id INTO child FROM runpool.runs k
    WHERE k.parent_id = run.id AND k.spawn_call_id = _spawn.call_id;
    IF child IS NOT NULL THEN
        RETURN child;
    END IF;
    -- parent_id has no foreign key: a child that ended may be deleted (a purge of finished
    -- runs) while its parent goes on. Spawned again by the resumed parent, it would run twice.
    -- The parent's own event of the spawn remains (its events go with it): refused instead.
    IF EXISTS (SELECT 1 FROM runpool.run_events e
               WHERE e.run_id = run.id AND e.kind = 'spawned'
                 AND e.detail ->> 'call_id' = _spawn.call_id) THEN
        RAISE EXCEPTION 'runpool._spawn: the child of call id % was spawned already and has'
            ' been deleted since (purged after it ended?): spawning it again would run it twice',
            _spawn.call_id USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF run.cancel_requested_at IS NOT NULL THEN
        RAISE EXCEPTION 'runpool._spawn: run % is being cancelled', run.id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    child := runpool.enqueue(tenant => run.tenant, handler => _spawn.handler,
                             input => _spawn.input, priority => _spawn.priority,
                             run_at => _spawn.run_at, max_attempts => _spawn.max_attempts,
                             traceparent => coalesce(_spawn.traceparent, run.traceparent),
                             timeout => _spawn.timeout, deadline => _spawn.deadline,
                             budget => _spawn.budget);
    UPDATE runpool.runs r SET parent_id = run.id, spawn_call_id = _spawn.call_id
    WHERE r.id = child;
    INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
    VALUES (run.id, 'spawned', run.attempt, run.worker_id,
            jsonb_build_object('child', child, 'call_id', _spawn.call_id));
    RETURN child;
END
$$;

-- Parents whose child ended while their row was held by someone else (their own wait or
-- spawn committing, an API call, a caller's open transaction): the next claim's wake_due
-- checks them. A child's end never waits for its parent's row (a caller holding the parent
-- must not stall a worker's batch of outcomes), and never misses the parent's wake-up.
CREATE TABLE runpool.join_checks (
    parent_id uuid NOT NULL,
    at        timestamptz NOT NULL DEFAULT now()
);

-- A parent whose row this transaction holds: if it waits to join children that have all
-- ended now, it is queued again. The row lock orders this against the parent's own join
-- commit (which checks its children after taking the same lock).
CREATE FUNCTION runpool._join_if_done(parent uuid) RETURNS boolean
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    pending runpool.waits;
BEGIN
    SELECT * INTO pending FROM runpool.waits x
    WHERE x.run_id = _join_if_done.parent AND x.state = 'pending' AND x.kind = 'join'
      AND EXISTS (SELECT 1 FROM runpool.runs p
                  WHERE p.id = x.run_id AND p.status = 'waiting')
    FOR NO KEY UPDATE SKIP LOCKED;
    IF NOT FOUND AND EXISTS (SELECT 1 FROM runpool.waits x
                             WHERE x.run_id = _join_if_done.parent AND x.state = 'pending'
                               AND x.kind = 'join') THEN
        -- Its wait's row is held by another session (a worker's outcome batch ending a
        -- child must not wait for it): left to the next claim, as a busy parent row is.
        INSERT INTO runpool.join_checks (parent_id) VALUES (_join_if_done.parent);
        RETURN false;
    END IF;
    IF NOT FOUND OR EXISTS (SELECT 1 FROM runpool.runs k
                            WHERE k.id = ANY(pending.children)
                              AND k.status NOT IN ('succeeded', 'failed', 'cancelled')) THEN
        RETURN false;
    END IF;
    UPDATE runpool.waits x SET state = 'joined', resolved_at = now()
    WHERE x.run_id = pending.run_id AND x.seq = pending.seq;
    PERFORM runpool._resume(ARRAY[pending.run_id], 'children');
    RETURN true;
END
$$;

-- A child ended: its parent is checked now if its row is free, else by the next claim.
CREATE FUNCTION runpool._child_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
BEGIN
    -- Locked unconditionally (a running parent too): its join commit then sees this end.
    PERFORM 1 FROM runpool.runs p WHERE p.id = NEW.parent_id
    FOR NO KEY UPDATE SKIP LOCKED;
    IF FOUND THEN
        PERFORM runpool._join_if_done(NEW.parent_id);
    ELSIF EXISTS (SELECT 1 FROM runpool.runs p WHERE p.id = NEW.parent_id) THEN
        INSERT INTO runpool.join_checks (parent_id) VALUES (NEW.parent_id);
    END IF;
    RETURN NULL;
END
$$;

-- Only rows of spawned runs that just ended fire it: a run without a parent pays the WHEN
-- test alone.
CREATE TRIGGER runs_child_ended AFTER UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (NEW.parent_id IS NOT NULL
      AND NEW.status IN ('succeeded', 'failed', 'cancelled')
      AND OLD.status NOT IN ('succeeded', 'failed', 'cancelled'))
EXECUTE FUNCTION runpool._child_ended();

-- Resume the waiting runs whose time has come (a sleep's end, a wait's timeout), and the
-- parents left to check by _child_ended. Called by queries.sql wake_due only when there is
-- such a run or parent. Rows someone else holds wait for the next claim.
CREATE FUNCTION runpool._wake_due() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
DECLARE
    due uuid[];
    parents uuid[];
    woken integer := 0;
BEGIN
    SELECT array_agg(d.id) INTO due FROM (
        SELECT r.id FROM runpool.waits w
        JOIN runpool.runs r ON r.id = w.run_id
        WHERE w.state = 'pending' AND w.until <= now() AND r.status = 'waiting'
        ORDER BY w.until LIMIT 1000
        -- The wait's row too: a session holding it (a SELECT ... FOR UPDATE left open) must
        -- not stall every claim of every worker; it is woken by a claim once free.
        FOR NO KEY UPDATE OF r, w SKIP LOCKED) d;
    IF due IS NOT NULL THEN
        UPDATE runpool.waits w SET
            state = CASE w.kind WHEN 'sleep' THEN 'woke' ELSE 'timed_out' END,
            resolved_at = now()
        WHERE w.run_id = ANY(due) AND w.state = 'pending';
        woken := runpool._resume(due, 'time');
    END IF;
    -- Parents whose row is free now (or gone: their checks are dropped too).
    SELECT array_agg(c.parent_id) INTO parents FROM (
        SELECT DISTINCT j.parent_id FROM runpool.join_checks j LIMIT 1000) c
    WHERE NOT EXISTS (SELECT 1 FROM runpool.runs p WHERE p.id = c.parent_id)
       OR EXISTS (SELECT 1 FROM runpool.runs p WHERE p.id = c.parent_id
                  FOR NO KEY UPDATE SKIP LOCKED);
    IF parents IS NOT NULL THEN
        DELETE FROM runpool.join_checks j WHERE j.parent_id = ANY(parents);
        woken := woken + (SELECT count(*) FILTER (WHERE runpool._join_if_done(p))
                          FROM unnest(parents) AS p);
    END IF;
    RETURN woken;
END
$$;

-- Send a signal to a run: 'delivered' (it was waiting for `name`: it is queued again),
-- 'stored' (kept until the run waits for `name`), the run's terminal status (nothing stored),
-- or NULL for no such run (or another tenant's). Each signal is consumed by one wait, in
-- arrival order per name.
CREATE FUNCTION runpool.signal_run(run_id uuid, name text, payload jsonb DEFAULT '{}',
                                   tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    w runpool.waits;
    stored integer;
    signal_id bigint;
    limit_bytes integer;
BEGIN
    IF signal_run.name IS NULL
       OR length(signal_run.name) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.signal_run: name must be 1 to % characters',
            runpool.max_name_length() USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF signal_run.payload IS NULL THEN
        RAISE EXCEPTION 'runpool.signal_run: payload must be a JSON value (''null''::jsonb for'
            ' none), not SQL NULL' USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT c.max_input_bytes INTO limit_bytes FROM runpool.config c;
    IF octet_length(signal_run.payload::text) > limit_bytes THEN
        RAISE EXCEPTION 'runpool.signal_run: payload is % bytes, over the limit of % bytes',
            octet_length(signal_run.payload::text), limit_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    -- Before the lock (as cancel_run): another tenant's run answers like a missing one.
    IF NOT runpool._run_of_tenant(signal_run.run_id, signal_run.tenant) THEN
        RETURN NULL;
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = signal_run.run_id FOR NO KEY UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status IN ('succeeded', 'failed', 'cancelled') THEN
        RETURN run.status;
    END IF;
    SELECT count(*) INTO stored FROM (
        SELECT 1 FROM runpool.signals s
        WHERE s.run_id = run.id AND s.consumed_by IS NULL
        LIMIT runpool.max_stored_signals()) x;
    IF stored >= runpool.max_stored_signals() THEN
        RAISE EXCEPTION 'runpool.signal_run: run % holds % signals not consumed yet, the limit',
            run.id, stored USING ERRCODE = 'program_limit_exceeded';
    END IF;
    INSERT INTO runpool.signals (run_id, name, payload)
    VALUES (run.id, signal_run.name, signal_run.payload);
    IF run.status = 'waiting' THEN
        SELECT * INTO w FROM runpool.waits x
        WHERE x.run_id = run.id AND x.state = 'pending' AND x.kind = 'signal'
          AND x.name = signal_run.name;
        IF FOUND THEN
            SELECT s.id INTO signal_id FROM runpool.signals s
            WHERE s.run_id = run.id AND s.name = w.name AND s.consumed_by IS NULL
            ORDER BY s.id LIMIT 1;
            UPDATE runpool.signals s SET consumed_by = w.seq, consumed_at = now()
            WHERE s.id = signal_id;
            UPDATE runpool.waits x SET state = 'signalled', resolved_at = now(),
                payload = (SELECT s.payload FROM runpool.signals s WHERE s.id = signal_id)
            WHERE x.run_id = run.id AND x.seq = w.seq;
            PERFORM runpool._resume(ARRAY[run.id], 'signal');
            RETURN 'delivered';
        END IF;
    END IF;
    RETURN 'stored';
END
$$;

-- Cancel one run, the body of cancel_run (latest: 0008) for the run and each of its
-- descendants, now also a waiting run at once ('cancelled'). Its answer: 'cancelled',
-- 'cancelling', the status of a run already ended, NULL for no such run.
CREATE FUNCTION runpool._cancel_one(run_id uuid, reason text) RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = _cancel_one.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status IN ('queued', 'waiting') THEN
        UPDATE runpool.runs r SET
            status = 'cancelled', finished_at = now(), held = false,
            cancel_requested_at = now(), cancel_reason = _cancel_one.reason
        WHERE r.id = run.id;
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        VALUES (run.id, 'cancelled', run.attempt, jsonb_build_object('reason', _cancel_one.reason));
        -- Its wait ends with it (no wake-up is due any more).
        UPDATE runpool.waits x SET state = 'cancelled', resolved_at = now()
        WHERE x.run_id = run.id AND x.state = 'pending';
        RETURN 'cancelled';
    ELSIF run.status = 'running' THEN
        IF run.cancel_requested_at IS NULL THEN
            UPDATE runpool.runs r SET cancel_requested_at = now(), cancel_reason = _cancel_one.reason
            WHERE r.id = run.id;
            INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
            VALUES (run.id, 'cancel_requested', run.attempt, run.worker_id,
                    jsonb_build_object('reason', _cancel_one.reason));
        END IF;
        -- Ids only: the worker re-reads the flag, so a forged notification is harmless.
        PERFORM pg_notify('runpool_cancel', run.id::text);
        RETURN 'cancelling';
    END IF;
    RETURN run.status;
END
$$;

-- Cancel a run (latest body: 0008) and its unfinished descendants.
CREATE OR REPLACE FUNCTION runpool.cancel_run(run_id uuid, reason text DEFAULT NULL,
                                              tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET runpool.release = ''
AS $$
#variable_conflict use_column
DECLARE
    answer text;
    generation uuid[];
BEGIN
    IF cancel_run.reason IS NOT NULL AND length(cancel_run.reason) > 2000 THEN
        RAISE EXCEPTION 'runpool.cancel_run: reason is longer than 2000 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A run's tenant never changes, so checking it before the lock is exact. Another tenant's
    -- run answers exactly like a missing one: no existence leak.
    IF NOT runpool._run_of_tenant(cancel_run.run_id, cancel_run.tenant) THEN
        RETURN NULL;
    END IF;
    answer := runpool._cancel_one(cancel_run.run_id, cancel_run.reason);
    IF answer IS NULL OR answer NOT IN ('cancelled', 'cancelling') THEN
        RETURN answer;
    END IF;
    -- The unfinished descendants, one generation at a time, each under its parent's lock (a
    -- parent marked cancelled spawns nothing more). A loop, not a recursive call per child:
    -- a chain of spawns (an agent spawning its own handler) may be thousands deep, and a
    -- recursion that deep ran out of the server's stack, cancelling nothing. A child's end
    -- never waits for its parent's row (see _child_ended), so holding the parent while
    -- locking its children cannot deadlock with a worker.
    generation := ARRAY[cancel_run.run_id];
    LOOP
        SELECT array_agg(k.id) INTO generation FROM runpool.runs k
        WHERE k.parent_id = ANY(generation) AND k.status IN ('queued', 'running', 'waiting');
        EXIT WHEN generation IS NULL;
        PERFORM runpool._cancel_one(k.id, cancel_run.reason) FROM unnest(generation) AS k(id);
    END LOOP;
    RETURN answer;
END
$$;

-- Replay a failed or cancelled run (latest body: 0008), now also a run failed by its wait's
-- timeout (reason wait_timeout): that wait, its last, is left unanswered ('cancelled'), so the
-- retry waits again (the handler's _wait reopens it) instead of meeting the same timeout.
CREATE OR REPLACE FUNCTION runpool.retry_run(run_id uuid)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
SET runpool.release = ''
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    step double precision;
    waits boolean := false;
    position bigint;
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = retry_run.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status NOT IN ('failed', 'cancelled') THEN
        RETURN run.status;
    END IF;
    IF run.serial_key IS NOT NULL THEN
        PERFORM pg_advisory_xact_lock(runpool.serial_key_lock(run.tenant, run.serial_key));
        position := nextval('runpool.serial_order');
        waits := current_setting('transaction_isolation') <> 'read committed'
                 OR EXISTS (SELECT 1 FROM runpool.runs r
                            WHERE r.tenant = run.tenant AND r.serial_key = run.serial_key
                              AND r.status IN ('queued', 'running') AND r.id <> run.id);
    END IF;
    SELECT aging_seconds INTO step FROM runpool.config;
    UPDATE runpool.runs r SET
        status = 'queued', attempt_offset = r.attempt, available_at = clock_timestamp(),
        rank = runpool.rank(clock_timestamp(), r.priority, step),
        finished_at = NULL, lease_expires_at = NULL, worker_id = NULL,
        cancel_requested_at = NULL, cancel_reason = NULL,
        serial_order = coalesce(position, r.serial_order), held = waits, deferred = false,
        paused = EXISTS (SELECT 1 FROM runpool.tenants t
                         WHERE t.tenant = r.tenant AND t.max_running = 0)
    WHERE r.id = run.id;
    IF run.status = 'failed' AND run.error ->> 'reason' = 'wait_timeout' THEN
        -- A WaitTimeout the handler did not catch comes from its last wait (a wait it caught
        -- stays timed out: the replay goes the same way past it).
        UPDATE runpool.waits x SET state = 'cancelled'
        WHERE x.run_id = run.id AND x.state = 'timed_out'
          AND x.seq = (SELECT max(l.seq) FROM runpool.waits l WHERE l.run_id = run.id);
    END IF;
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'retried', run.attempt, jsonb_build_object('from', run.status));
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN 'queued';
END
$$;

-- Describe a run (latest body: 0008), now with what a waiting run waits for.
CREATE OR REPLACE FUNCTION runpool.explain_run(run_id uuid)
RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    quota integer;
    live integer;
    ahead bigint;
    blocker uuid;
    holder integer;
    served boolean;
    reasons jsonb := '[]';
    doc jsonb;
    pending runpool.waits;
    unfinished uuid[];
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = explain_run.run_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    doc := jsonb_build_object(
        'run_id', run.id, 'tenant', run.tenant, 'handler', run.handler, 'status', run.status,
        'priority', run.priority, 'attempt', run.attempt, 'max_attempts', run.max_attempts,
        'attempts_left', run.max_attempts - runpool.attempts_used(run.attempt, run.attempt_offset),
        'created_at', run.created_at, 'serial_key', run.serial_key,
        'parent_id', run.parent_id);
    IF run.status = 'waiting' THEN
        SELECT * INTO pending FROM runpool.waits x WHERE x.run_id = run.id AND x.state = 'pending';
        IF pending.kind = 'join' THEN
            SELECT array_agg(k.id ORDER BY k.id) INTO unfinished FROM runpool.runs k
            WHERE k.id = ANY(pending.children)
              AND k.status NOT IN ('succeeded', 'failed', 'cancelled');
        END IF;
        RETURN doc || jsonb_build_object(
            'waiting_for', jsonb_strip_nulls(jsonb_build_object(
                'kind', pending.kind, 'seq', pending.seq, 'name', pending.name,
                'since', pending.since, 'until', pending.until, 'children', to_jsonb(pending.children),
                'children_running', to_jsonb(unfinished))),
            'summary', CASE pending.kind
                WHEN 'signal' THEN format('waiting for signal %s since %s%s', pending.name,
                    pending.since, CASE WHEN pending.until IS NOT NULL
                                        THEN format(' (times out at %s)', pending.until)
                                        ELSE '' END)
                WHEN 'sleep' THEN format('sleeping until %s', pending.until)
                ELSE format('waiting for %s of %s children to end since %s%s',
                            coalesce(cardinality(unfinished), 0), cardinality(pending.children),
                            pending.since,
                            CASE WHEN pending.until IS NOT NULL
                                 THEN format(' (times out at %s)', pending.until) ELSE '' END)
                END);
    ELSIF run.status = 'running' THEN
        RETURN doc || jsonb_build_object(
            'worker_id', run.worker_id, 'started_at', run.started_at,
            'lease_expires_at', run.lease_expires_at,
            'lease_expired', run.lease_expires_at < now(),
            'cancel_requested_at', run.cancel_requested_at,
            'summary', CASE
                WHEN run.lease_expires_at < now()
                THEN 'lease expired: the next claim reclaims it'
                WHEN run.cancel_requested_at IS NOT NULL THEN 'running; cancellation requested'
                ELSE 'running' END);
    ELSIF run.status <> 'queued' THEN
        RETURN doc || jsonb_build_object(
            'finished_at', run.finished_at, 'result', run.result, 'error', run.error,
            'cancel_reason', run.cancel_reason,
            'summary', run.status || CASE WHEN run.status = 'failed'
                THEN ' (dead letter: runpool.retry_run replays it)' ELSE '' END);
    END IF;

    -- A live pool: not stopped, seen within the last minute (pools touch every heartbeat).
    -- With no live pool at all nothing is served, which says nothing about this handler: NULL.
    SELECT bool_or(w.handlers IS NULL OR run.handler = ANY(w.handlers)) INTO served
    FROM runpool.workers w
    WHERE w.stopped_at IS NULL AND w.last_seen_at > now() - interval '1 minute';
    IF NOT served THEN
        reasons := reasons || jsonb_build_array(format(
            'no live pool serves handler %s: it waits until one does (it never fails for it)',
            run.handler));
    END IF;
    SELECT q.quota, q.live INTO quota, live FROM runpool.tenant_capacity q
    WHERE q.tenant = run.tenant;
    IF quota IS NOT NULL AND live >= quota THEN
        reasons := reasons || jsonb_build_array(CASE WHEN quota = 0
            THEN format('tenant %s is paused (quota 0)', run.tenant)
            ELSE format('tenant %s at quota %s/%s', run.tenant, live, quota) END);
    END IF;
    IF run.held THEN
        SELECT b.id INTO blocker FROM runpool.runs b
        WHERE b.tenant = run.tenant AND b.serial_key = run.serial_key
          AND b.status IN ('queued', 'running') AND NOT b.held;
        IF blocker IS NULL THEN
            -- A session holding the key's lock (7370) or commit lock (7371) keeps the sweep
            -- off the key while it does: any login that can connect can take them (README:
            -- Hostile tenants and logins), so name it. A bigint advisory key is stored as
            -- classid (high 32 bits) and objid (low 32 bits), objsubid 1.
            SELECT min(l.pid) INTO holder FROM pg_locks l
            CROSS JOIN LATERAL (VALUES
                (runpool.serial_key_lock(run.tenant, run.serial_key)),
                (runpool.serial_commit_lock(run.tenant, run.serial_key))) AS k(lock)
            WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
              AND l.database = (SELECT d.oid FROM pg_database d
                                WHERE d.datname = current_database())
              AND l.classid = ((k.lock >> 32) & 4294967295)::oid
              AND l.objid = (k.lock & 4294967295)::oid
              AND l.pid <> pg_backend_pid();
        END IF;
        reasons := reasons || jsonb_build_array(CASE
            WHEN blocker IS NOT NULL
            THEN format('waiting for run %s of the same serial key %s', blocker,
                        run.serial_key)
            WHEN holder IS NOT NULL
            THEN format('next in line of serial key %s, whose lock session pid %s holds:'
                        ' released once that session''s transaction ends (pg_stat_activity'
                        ' shows it; pg_terminate_backend ends it)', run.serial_key, holder)
            ELSE format('next in line of serial key %s: released within a heartbeat',
                        run.serial_key) END);
    END IF;
    IF run.available_at > now() THEN
        reasons := reasons || jsonb_build_array(
            format('not available until %s (scheduled or retry backoff)', run.available_at));
    END IF;
    -- Runs that will be claimed first: this tenant's better-ranked runs, and other tenants'
    -- better-ranked available runs. Capped so that explaining never costs a full scan.
    SELECT count(*) INTO ahead FROM (
        SELECT 1 FROM runpool.runs o
        WHERE o.status = 'queued' AND o.rank < run.rank AND o.available_at <= now()
        LIMIT 10000) x;
    RETURN doc || jsonb_build_object(
        'available_at', run.available_at, 'rank', run.rank,
        'tenant_running', live, 'tenant_quota', quota, 'handler_served', served,
        'runs_ahead', ahead, 'runs_ahead_capped', ahead >= 10000,
        'held_by', reasons,
        'summary', CASE WHEN jsonb_array_length(reasons) = 0
            THEN format('waiting for a free slot; %s%s runs ahead of it', ahead,
                        CASE WHEN ahead >= 10000 THEN '+' ELSE '' END)
            ELSE reasons ->> 0 END);
END
$$;

-- A status change's live event (latest body: 0009), now saying what a run waits for
-- ('signal', 'sleep', 'join') and that a queued run was resumed from its wait; a run starting
-- to wait rings its doorbell too (a follower shows it waiting at once; waits are rare beside
-- claims, which stay notification-free).
CREATE OR REPLACE FUNCTION runpool._run_status_changed() RETURNS trigger
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
        WHEN NEW.status = 'waiting' THEN (SELECT w.kind FROM runpool.waits w
                                         WHERE w.run_id = NEW.id AND w.state = 'pending')
        WHEN NEW.status = 'queued' AND OLD.status = 'waiting' THEN 'resumed'
        WHEN NEW.status = 'queued' AND OLD.status = 'running' THEN CASE
            WHEN NEW.attempt_offset > OLD.attempt_offset THEN 'released'
            WHEN NEW.deferred OR NEW.error IS DISTINCT FROM OLD.error
                THEN coalesce(NEW.error->>'reason', 'retry')
            ELSE 'lease_expired' END
        WHEN NEW.status = 'queued' THEN 'retried'
    END);
    IF NEW.status IN ('succeeded', 'failed', 'cancelled', 'waiting') THEN
        PERFORM runpool._ring(NEW.id);
    END IF;
    RETURN NEW;
END
$$;

REVOKE ALL ON FUNCTION
    runpool.max_stored_signals(),
    runpool._resume(uuid[], text),
    runpool._wake_due(),
    runpool._wait(uuid, integer, integer, text, text, uuid[], double precision,
                  double precision),
    runpool._spawn(uuid, integer, text, text, jsonb, integer, timestamptz, integer, text,
                   interval, timestamptz, jsonb),
    runpool._join_if_done(uuid),
    runpool._child_ended(),
    runpool._cancel_one(uuid, text),
    runpool.signal_run(uuid, text, jsonb, text)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION runpool.max_stored_signals() TO runpool_api, runpool_worker;
GRANT EXECUTE ON FUNCTION runpool.signal_run(uuid, text, jsonb, text)
TO runpool_api, runpool_worker;
-- The worker's own: waits, spawns and the wake-up of due waits (its claim calls it).
GRANT EXECUTE ON FUNCTION
    runpool._wake_due(),
    runpool._wait(uuid, integer, integer, text, text, uuid[], double precision,
                  double precision),
    runpool._spawn(uuid, integer, text, text, jsonb, integer, timestamptz, integer, text,
                   interval, timestamptz, jsonb)
TO runpool_worker;
GRANT SELECT ON runpool.waits, runpool.signals, runpool.join_checks TO runpool_api, runpool_worker;
-- The deadline sweep (queries.sql expire_deadlines, run by workers) closes a waiting run's wait.
GRANT UPDATE (state, resolved_at) ON runpool.waits TO runpool_worker;
