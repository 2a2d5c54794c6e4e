-- 0008_rules: each business rule is defined once (issue 12), and everything else uses it.
--
-- The rules below were written out in several statements each (queries.sql and the functions
-- of 0002-0007). They are SQL functions PostgreSQL inlines (LANGUAGE sql, one expression, not
-- SECURITY DEFINER, no SET: the planner substitutes the expression, so a call costs nothing;
-- tests/test_rules.py checks it)
-- or views (inlined by the rewriter), and the functions that restated them are replaced below
-- by bodies that use them. SQL-standard bodies bind their names when created: no search_path
-- can redirect them.

-- The attempts a run has used of its max_attempts: attempts released by a draining worker
-- and everything before a retry_run (attempt_offset) do not count. Columns, not the row: a
-- SQL-standard body taking runs' row type would pin it (no column could be added to runs).
CREATE FUNCTION runpool.attempts_used(attempt integer, attempt_offset integer) RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN attempt - attempt_offset;

-- A run's place in the queue: its arrival in epoch seconds, earlier by aging_seconds per
-- priority point (claiming by ascending rank is priority order with linear aging).
CREATE FUNCTION runpool.rank(arrival timestamptz, priority integer,
                             aging_seconds double precision) RETURNS double precision
LANGUAGE sql STABLE PARALLEL SAFE
RETURN extract(epoch FROM arrival) - priority * aging_seconds;

-- The advisory lock of a serial key, held by whoever decides which of its runs is the head.
CREATE FUNCTION runpool.serial_key_lock(tenant text, serial_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended(tenant || chr(31) || serial_key, 7370);

-- The key's commit lock (see 0006): a release holds it shared, a commit check exclusively.
CREATE FUNCTION runpool.serial_commit_lock(tenant text, serial_key text) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN hashtextextended(tenant || chr(31) || serial_key, 7371);

-- The longest tenant, handler, idempotency key, serial key, tool call id and tool name.
-- Python's checks (runpool.limits.NAME_MAX_LENGTH) and the tables' CHECK constraints spell
-- the number out, and tests/test_rules.py holds each of them equal to this: a function call
-- in a CHECK constraint is planned again on every insert (+30 % of an enqueue's CPU).
CREATE FUNCTION runpool.max_name_length() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE
RETURN 200;

-- Whether a tenant-scoped call may see a run: with no tenant given (the operator) always;
-- otherwise only a run of that tenant. Another tenant's run and a missing one answer alike,
-- by the same single probe: no existence or timing leak. Once per API call: not inlined.
CREATE FUNCTION runpool._run_of_tenant(run_id uuid, tenant text) RETURNS boolean
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
RETURN _run_of_tenant.tenant IS NULL
    OR EXISTS (SELECT 1 FROM runpool.runs r
               WHERE r.id = _run_of_tenant.run_id AND r.tenant = _run_of_tenant.tenant);

-- A tenant's quota (its own, else the pool-wide default; NULL: no limit) and its live leases
-- (running, lease not expired: an expired lease stops counting the moment it expires).
CREATE VIEW runpool.tenant_capacity AS
SELECT t.tenant,
       coalesce(t.max_running, c.default_quota) AS quota,
       (SELECT count(*) FROM runpool.runs l
        WHERE l.tenant = t.tenant AND l.status = 'running' AND l.lease_expires_at > now()) AS live
FROM runpool.tenants t CROSS JOIN runpool.config c;

-- The runs that can start now: queued, not waiting behind their serial key, not waiting for
-- their time, not of a paused tenant. The index runs_ready (0006) has this predicate: the
-- claim's probes read it through this view (tests/test_rules.py checks the plans use it).
CREATE VIEW runpool.ready_runs AS
SELECT r.id, r.tenant, r.handler, r.rank, r.available_at
FROM runpool.runs r
WHERE r.status = 'queued' AND NOT r.held AND NOT r.deferred AND NOT r.paused;

-- The key's lock (see 0002), named once. enqueue and retry_run no longer call it: a nested
-- SECURITY DEFINER call costs more than the lock (they take it through serial_key_lock).
CREATE OR REPLACE FUNCTION runpool._lock_serial_key(tenant text, serial_key text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$ SELECT pg_advisory_xact_lock(runpool.serial_key_lock(tenant, serial_key)) $$;

-- The release of a key's next run (see 0006), with the commit lock named once.
CREATE OR REPLACE FUNCTION runpool._serial_key_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed'
       OR NOT pg_try_advisory_xact_lock_shared(
           runpool.serial_commit_lock(NEW.tenant, NEW.serial_key)) THEN
        RETURN NULL;
    END IF;
    -- A statement of its own, after the commit lock: it sees every enqueue committed before.
    UPDATE runpool.runs r SET held = false
    WHERE r.id = (SELECT w.id FROM runpool.runs w
                  WHERE w.tenant = NEW.tenant AND w.serial_key = NEW.serial_key AND w.held
                  ORDER BY w.serial_order LIMIT 1 FOR UPDATE SKIP LOCKED)
      AND r.held;
    IF FOUND AND current_setting('runpool.session', true) IS DISTINCT FROM 'worker' THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;

-- The commit check of a held run (see 0006), with the commit lock named once.
CREATE OR REPLACE FUNCTION runpool._serial_key_waits() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RETURN NULL;  -- its snapshot is older than the lock: heal_serial_keys decides
    END IF;
    PERFORM pg_advisory_xact_lock(runpool.serial_commit_lock(NEW.tenant, NEW.serial_key));
    UPDATE runpool.runs r SET held = false
    WHERE r.id = (SELECT w.id FROM runpool.runs w
                  WHERE w.tenant = NEW.tenant AND w.serial_key = NEW.serial_key AND w.held
                  ORDER BY w.serial_order LIMIT 1 FOR UPDATE SKIP LOCKED)
      AND r.held
      AND NOT EXISTS (SELECT 1 FROM runpool.runs a
                      WHERE a.tenant = NEW.tenant AND a.serial_key = NEW.serial_key
                        AND a.status IN ('queued', 'running') AND NOT a.held);
    IF FOUND THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;

-- The heal sweep (see 0006), with the key's lock named once.
CREATE OR REPLACE FUNCTION runpool.heal_serial_keys() RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
SET runpool.release = ''
AS $$
DECLARE
    k record;
    healed integer := 0;
    one integer;
    budget constant integer := 100;
    visited integer;
    tenants text[];
    serial_keys text[];
    after_tenant text := nullif(current_setting('runpool.heal_after_tenant', true), '');
    after_key text := coalesce(current_setting('runpool.heal_after_key', true), '');
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'runpool.heal_serial_keys: needs READ COMMITTED, not %',
            upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    -- SKIP LOCKED, here as below: the sweep runs on the heartbeat's connection and must
    -- never wait for a caller.
    UPDATE runpool.runs r SET paused = false
    WHERE r.id IN (SELECT p.id FROM runpool.runs p
                   WHERE p.paused AND p.status IN ('queued', 'running')
                     AND NOT EXISTS (SELECT 1 FROM runpool.tenants t
                                     WHERE t.tenant = p.tenant AND t.max_running = 0)
                   FOR NO KEY UPDATE SKIP LOCKED);
    -- One sweep visits at most 100 keys (about 2 ms), from where the previous sweep of this
    -- session stopped: its cost never grows with the number of keys that have waiting runs
    -- (1,501 such keys cost 31 ms a sweep), and every key is still visited within
    -- ceil(keys / 100) sweeps. The place is kept in a session setting (a connection that is
    -- new, or a transaction rolled back, starts again from the first key). Set-based, so that
    -- a sweep plans two statements, not three per key.
    WITH RECURSIVE keys AS (
        -- A loose index scan: one probe per key with held runs.
        (SELECT h.tenant, h.serial_key FROM runpool.runs h
         WHERE h.held AND (after_tenant IS NULL
                           OR (h.tenant, h.serial_key) > (after_tenant, after_key))
         ORDER BY h.tenant, h.serial_key LIMIT 1)
        UNION ALL
        SELECT n.tenant, n.serial_key
        FROM keys p CROSS JOIN LATERAL (
            SELECT h.tenant, h.serial_key FROM runpool.runs h
            WHERE h.held AND (h.tenant, h.serial_key) > (p.tenant, p.serial_key)
            ORDER BY h.tenant, h.serial_key LIMIT 1) n
    )
    SELECT array_agg(w.tenant), array_agg(w.serial_key) INTO tenants, serial_keys
    FROM (SELECT keys.tenant, keys.serial_key FROM keys LIMIT budget) w;
    visited := coalesce(cardinality(tenants), 0);
    FOR k IN
        SELECT v.tenant, v.serial_key
        FROM unnest(tenants, serial_keys) AS v(tenant, serial_key)
        WHERE NOT EXISTS (SELECT 1 FROM runpool.runs a
                          WHERE a.tenant = v.tenant AND a.serial_key = v.serial_key
                            AND a.status IN ('queued', 'running') AND NOT a.held)
    LOOP
        CONTINUE WHEN NOT pg_try_advisory_xact_lock(runpool.serial_key_lock(k.tenant, k.serial_key));
        -- A statement of its own, after the lock: it sees every decision made before it.
        -- SKIP LOCKED: a waiting run being cancelled right now is passed over.
        UPDATE runpool.runs r SET held = false
        WHERE r.id = (SELECT w.id FROM runpool.runs w
                      WHERE w.tenant = k.tenant AND w.serial_key = k.serial_key AND w.held
                      ORDER BY w.serial_order LIMIT 1 FOR UPDATE SKIP LOCKED)
          AND r.held
          AND NOT EXISTS (SELECT 1 FROM runpool.runs a
                          WHERE a.tenant = k.tenant AND a.serial_key = k.serial_key
                            AND a.status IN ('queued', 'running') AND NOT a.held);
        GET DIAGNOSTICS one = ROW_COUNT;
        healed := healed + one;
    END LOOP;
    -- Past the last key, the next sweep starts again from the first.
    PERFORM set_config('runpool.heal_after_tenant',
                       CASE WHEN visited < budget THEN '' ELSE tenants[visited] END, false),
            set_config('runpool.heal_after_key',
                       CASE WHEN visited < budget THEN '' ELSE serial_keys[visited] END, false);
    IF healed > 0 THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN healed;
END
$$;

-- Enqueue one run (see 0006): its rank and the name lengths come from their definitions.
CREATE OR REPLACE FUNCTION runpool.enqueue(
    tenant text,
    handler text,
    input jsonb DEFAULT '{}',
    priority integer DEFAULT 0,
    idempotency_key text DEFAULT NULL,
    run_at timestamptz DEFAULT NULL,
    max_attempts integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    serial_key text DEFAULT NULL
) RETURNS uuid
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = auto
AS $$
#variable_conflict use_column
DECLARE
    cfg runpool.config;
    -- clock_timestamp, not now(): runs enqueued in one transaction keep their order.
    available timestamptz;
    new_id uuid;
    waits boolean := false;
    position bigint;
    is_paused boolean;
    -- Computed apart from the INSERT (a simple expression, planned once per session): the
    -- keyed path replans its statements on every call, and the rule would be inlined anew.
    new_rank double precision;
BEGIN
    IF enqueue.tenant IS NULL OR length(enqueue.tenant) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: tenant must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.handler IS NULL OR length(enqueue.handler) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: handler must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.priority IS NULL OR enqueue.priority NOT BETWEEN -100 AND 100 THEN
        RAISE EXCEPTION 'runpool.enqueue: priority must be between -100 and 100, got %',
            coalesce(enqueue.priority::text, 'NULL') USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.max_attempts IS NOT NULL AND enqueue.max_attempts NOT BETWEEN 1 AND 1000 THEN
        RAISE EXCEPTION 'runpool.enqueue: max_attempts must be between 1 and 1000, got %',
            enqueue.max_attempts USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.idempotency_key IS NOT NULL AND length(enqueue.idempotency_key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: idempotency_key must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.serial_key IS NOT NULL AND length(enqueue.serial_key) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.enqueue: serial_key must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.traceparent IS NOT NULL AND length(enqueue.traceparent) > 128 THEN
        RAISE EXCEPTION 'runpool.enqueue: traceparent is longer than 128 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- 'infinity' would make a run that never starts yet is kept forever; a date centuries
    -- away is a unit mistake (milliseconds taken for seconds), not a plan.
    IF enqueue.run_at IS NOT NULL AND (NOT isfinite(enqueue.run_at)
                                       OR enqueue.run_at > clock_timestamp() + interval '10 years') THEN
        RAISE EXCEPTION 'runpool.enqueue: run_at must be a finite time at most 10 years ahead, got %',
            enqueue.run_at USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO cfg FROM runpool.config;
    IF octet_length(coalesce(enqueue.input, '{}')::text) > cfg.max_input_bytes THEN
        RAISE EXCEPTION 'runpool.enqueue: input is % bytes, over the limit of % bytes',
            octet_length(enqueue.input::text), cfg.max_input_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;

    IF enqueue.serial_key IS NOT NULL THEN
        -- Custom plans for the rest of this call (the SET above scopes it to the call): the
        -- generic plan PL/pgSQL switches to after five calls estimates the key check below
        -- from every tenant's keyed runs and reads the whole table once they are many. The
        -- unkeyed path keeps its cached plans (replanning it costs ~25 % of an enqueue).
        PERFORM set_config('plan_cache_mode', 'force_custom_plan', true);
        -- Under the key's lock, and in statements of their own: the check below sees every
        -- run of the key committed before the lock was granted (read committed only).
        PERFORM pg_advisory_xact_lock(runpool.serial_key_lock(enqueue.tenant, enqueue.serial_key));
        position := nextval('runpool.serial_order');
        waits := current_setting('transaction_isolation') <> 'read committed'
                 OR EXISTS (SELECT 1 FROM runpool.runs r
                            WHERE r.tenant = enqueue.tenant AND r.serial_key = enqueue.serial_key
                              AND r.status IN ('queued', 'running'));
    END IF;

    INSERT INTO runpool.tenants (tenant) VALUES (enqueue.tenant) ON CONFLICT DO NOTHING;
    is_paused := EXISTS (SELECT 1 FROM runpool.tenants t
                         WHERE t.tenant = enqueue.tenant AND t.max_running = 0);
    available := greatest(coalesce(enqueue.run_at, clock_timestamp()), clock_timestamp());
    new_rank := runpool.rank(available, enqueue.priority, cfg.aging_seconds);
    INSERT INTO runpool.runs AS r (
        tenant, handler, input, priority, idempotency_key, available_at, rank,
        max_attempts, traceparent, serial_key, serial_order, held, deferred, paused
    ) VALUES (
        enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'), enqueue.priority,
        enqueue.idempotency_key, available,
        new_rank,
        coalesce(enqueue.max_attempts, cfg.default_max_attempts), enqueue.traceparent,
        enqueue.serial_key, position, waits,
        coalesce(enqueue.run_at > clock_timestamp(), false), is_paused
    )
    ON CONFLICT (tenant, idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING r.id INTO new_id;

    IF new_id IS NULL THEN
        -- A concurrent or earlier enqueue won; under READ COMMITTED this statement sees it.
        SELECT r.id INTO new_id FROM runpool.runs r
        WHERE r.tenant = enqueue.tenant AND r.idempotency_key = enqueue.idempotency_key;
        RETURN new_id;
    END IF;

    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (new_id, 'enqueued', 0, CASE WHEN waits
        THEN jsonb_build_object('held_by_serial_key', enqueue.serial_key) END);
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN new_id;
END
$$;

-- Cancel a run (see 0006): the tenant probe comes from its definition.
CREATE OR REPLACE FUNCTION runpool.cancel_run(run_id uuid, reason text DEFAULT NULL,
                                              tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET runpool.release = ''
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
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
    SELECT * INTO run FROM runpool.runs r WHERE r.id = cancel_run.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status = 'queued' THEN
        UPDATE runpool.runs r SET
            status = 'cancelled', finished_at = now(), held = false,
            cancel_requested_at = now(), cancel_reason = cancel_run.reason
        WHERE r.id = run.id;
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        VALUES (run.id, 'cancelled', run.attempt, jsonb_build_object('reason', cancel_run.reason));
        RETURN 'cancelled';
    ELSIF run.status = 'running' THEN
        IF run.cancel_requested_at IS NULL THEN
            UPDATE runpool.runs r SET cancel_requested_at = now(), cancel_reason = cancel_run.reason
            WHERE r.id = run.id;
            INSERT INTO runpool.run_events (run_id, kind, attempt, worker_id, detail)
            VALUES (run.id, 'cancel_requested', run.attempt, run.worker_id,
                    jsonb_build_object('reason', cancel_run.reason));
        END IF;
        -- Ids only: the worker re-reads the flag, so a forged notification is harmless.
        PERFORM pg_notify('runpool_cancel', run.id::text);
        RETURN 'cancelling';
    END IF;
    RETURN run.status;
END
$$;

-- Retry a failed or cancelled run (see 0006): its rank comes from its definition.
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
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'retried', run.attempt, jsonb_build_object('from', run.status));
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN 'queued';
END
$$;

-- The tenant-scoped retry (see 0006).
CREATE OR REPLACE FUNCTION runpool.retry_run(run_id uuid, tenant text)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET runpool.release = ''
AS $$
#variable_conflict use_column
BEGIN
    IF NOT runpool._run_of_tenant(retry_run.run_id, retry_run.tenant) THEN
        RETURN NULL;
    END IF;
    RETURN runpool.retry_run(retry_run.run_id);
END
$$;

-- Set a tenant's quota (see 0006): the name length comes from its definition.
CREATE OR REPLACE FUNCTION runpool.set_tenant_quota(tenant text, max_running integer)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
SET plan_cache_mode = force_custom_plan
AS $$
#variable_conflict use_column
BEGIN
    IF set_tenant_quota.tenant IS NULL OR length(set_tenant_quota.tenant) NOT BETWEEN 1 AND runpool.max_name_length() THEN
        RAISE EXCEPTION 'runpool.set_tenant_quota: tenant must be 1 to % characters',
            runpool.max_name_length()
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF set_tenant_quota.max_running IS NOT NULL
       AND set_tenant_quota.max_running NOT BETWEEN 0 AND 1000000 THEN
        RAISE EXCEPTION 'runpool.set_tenant_quota: max_running must be between 0 and 1000000, got %',
            set_tenant_quota.max_running USING ERRCODE = 'invalid_parameter_value';
    END IF;
    INSERT INTO runpool.tenants AS t (tenant, max_running)
    VALUES (set_tenant_quota.tenant, set_tenant_quota.max_running)
    ON CONFLICT (tenant) DO UPDATE SET max_running = excluded.max_running;
    UPDATE runpool.runs r SET paused = (set_tenant_quota.max_running IS NOT DISTINCT FROM 0)
    WHERE r.tenant = set_tenant_quota.tenant AND r.status IN ('queued', 'running')
      AND r.paused IS DISTINCT FROM (set_tenant_quota.max_running IS NOT DISTINCT FROM 0);
    -- A raised quota frees capacity that idle workers should use now.
    PERFORM pg_notify('runpool_wakeup', '');
END
$$;

-- Describe a run (see 0006): attempts, capacity and the key's locks from their definitions.
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
BEGIN
    SELECT * INTO run FROM runpool.runs r WHERE r.id = explain_run.run_id;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    doc := jsonb_build_object(
        'run_id', run.id, 'tenant', run.tenant, 'handler', run.handler, 'status', run.status,
        'priority', run.priority, 'attempt', run.attempt, 'max_attempts', run.max_attempts,
        'attempts_left', run.max_attempts - runpool.attempts_used(run.attempt, run.attempt_offset),
        'created_at', run.created_at, 'serial_key', run.serial_key);
    IF run.status = 'running' THEN
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

-- The tenant-scoped explain (see 0006).
CREATE OR REPLACE FUNCTION runpool.explain_run(run_id uuid, tenant text)
RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
BEGIN
    IF NOT runpool._run_of_tenant(explain_run.run_id, explain_run.tenant) THEN
        RETURN NULL;
    END IF;
    RETURN runpool.explain_run(explain_run.run_id);
END
$$;

-- Resolve a tool call (see 0007): the tenant probe comes from its definition.
CREATE OR REPLACE FUNCTION runpool.resolve_tool_call(run_id uuid, call_id text, result jsonb DEFAULT NULL,
                                          retry boolean DEFAULT false, tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, runpool, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    call runpool.tool_calls;
    rewritten integer;
BEGIN
    IF (resolve_tool_call.result IS NULL) = (resolve_tool_call.retry IS NOT TRUE) THEN
        RAISE EXCEPTION 'runpool.resolve_tool_call: give either a result or retry => true'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Checked before the row lock (as cancel_run does; a run's tenant never changes): a refused
    -- call in a caller's open transaction must hold no lock on another tenant's running run,
    -- whose heartbeat would skip it until the lease ran out. Another tenant's run answers
    -- exactly like a missing one, by the same single probe: no existence or timing leak.
    IF NOT runpool._run_of_tenant(resolve_tool_call.run_id, resolve_tool_call.tenant) THEN
        RETURN NULL;
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = resolve_tool_call.run_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT * INTO call FROM runpool.tool_calls t
    WHERE t.run_id = run.id AND t.call_id = resolve_tool_call.call_id FOR UPDATE;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    IF run.status = 'running' THEN
        RAISE EXCEPTION 'runpool.resolve_tool_call: run % is running; cancel it or wait until it ends',
            run.id USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    IF resolve_tool_call.retry THEN
        DELETE FROM runpool.messages m WHERE m.run_id = run.id AND m.call_id = call.call_id;
        DELETE FROM runpool.tool_calls t WHERE t.run_id = run.id AND t.call_id = call.call_id;
        INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
        VALUES (run.id, 'tool_call_resolved', run.attempt,
                jsonb_build_object('call_id', call.call_id, 'from', call.status, 'to', 'retry'));
        RETURN 'retry';
    END IF;
    UPDATE runpool.tool_calls t
    SET status = 'succeeded', result = resolve_tool_call.result, finished_at = now()
    WHERE t.run_id = run.id AND t.call_id = call.call_id;
    -- The model sees the resolution where it saw the call's outcome (or after the history).
    UPDATE runpool.messages m SET content = resolve_tool_call.result
    WHERE m.run_id = run.id AND m.call_id = call.call_id;
    GET DIAGNOSTICS rewritten = ROW_COUNT;
    IF rewritten = 0 THEN
        INSERT INTO runpool.messages (run_id, seq, role, content, attempt, call_id)
        SELECT run.id, coalesce(max(m.seq), 0) + 1, 'tool', resolve_tool_call.result,
               run.attempt, call.call_id
        FROM runpool.messages m WHERE m.run_id = run.id;
    END IF;
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'tool_call_resolved', run.attempt,
            jsonb_build_object('call_id', call.call_id, 'from', call.status, 'to', 'succeeded'));
    RETURN 'succeeded';
END
$$;

-- The rules are the workers' and the API's to use (the worker's statements call them; the
-- functions above call them as their owner); _run_of_tenant is the owner's alone. The rule
-- functions are neither SECURITY DEFINER nor SET: either would stop the planner inlining
-- them, and they act with no rights of their own (pure expressions).
REVOKE ALL ON FUNCTION
    runpool.attempts_used(integer, integer),
    runpool.rank(timestamptz, integer, double precision),
    runpool.serial_key_lock(text, text),
    runpool.serial_commit_lock(text, text),
    runpool.max_name_length(),
    runpool._run_of_tenant(uuid, text)
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    runpool.attempts_used(integer, integer),
    runpool.rank(timestamptz, integer, double precision),
    runpool.serial_key_lock(text, text),
    runpool.serial_commit_lock(text, text),
    runpool.max_name_length()
TO runpool_api, runpool_worker;
GRANT SELECT ON runpool.tenant_capacity, runpool.ready_runs TO runpool_api, runpool_worker;
