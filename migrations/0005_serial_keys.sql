-- 0005_serial_keys: runs sharing (tenant, serial_key) run one at a time, in enqueue order.
--
-- Only a key's head (its earliest non-terminal run) is ever claimable: every later run of the
-- key waits with held = true, outside the claim index, so a key with 10,000 waiting runs costs
-- the claim nothing. When the head ends, the next run is released in the same transaction.
-- Enqueue and release take the key's advisory lock, so neither can miss the other.

ALTER TABLE runpool.runs
    ADD COLUMN serial_key text
        CONSTRAINT serial_key_length CHECK (length(serial_key) BETWEEN 1 AND 200),
    ADD COLUMN serial_order bigint,
    -- Waiting behind an earlier run of its serial key; only ever true while queued.
    ADD COLUMN held boolean NOT NULL DEFAULT false,
    ADD CONSTRAINT held_only_queued CHECK (NOT held OR status = 'queued');

CREATE SEQUENCE runpool.serial_order;

-- The claim index now leaves held runs out.
DROP INDEX runpool.runs_queue;
CREATE INDEX runs_queue ON runpool.runs (tenant, rank) WHERE status = 'queued' AND NOT held;
-- A key's waiting runs, in order (for releasing the next one).
CREATE INDEX runs_serial_held ON runpool.runs (tenant, serial_key, serial_order) WHERE held;
-- A key's runs that still block it.
CREATE INDEX runs_serial_active ON runpool.runs (tenant, serial_key)
    WHERE serial_key IS NOT NULL AND status IN ('queued', 'running');

-- The key's lock: taken by enqueue and by the release of the next run.
CREATE FUNCTION runpool._lock_serial_key(tenant text, serial_key text) RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$ SELECT pg_advisory_xact_lock(hashtextextended(tenant || chr(31) || serial_key, 7370)) $$;

-- When a keyed run ends (finish, reap, release, cancel, even a manual UPDATE), release the
-- next waiting run of its key. A row trigger whose WHEN clause is checked before any function
-- call, so unkeyed runs pay nothing. The key's lock comes first and the release is a statement
-- of its own, so it sees every enqueue committed before the lock was granted.
CREATE FUNCTION runpool._serial_key_ended() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
BEGIN
    PERFORM runpool._lock_serial_key(NEW.tenant, NEW.serial_key);
    UPDATE runpool.runs r SET held = false
    WHERE r.id = (SELECT w.id FROM runpool.runs w
                  WHERE w.tenant = NEW.tenant AND w.serial_key = NEW.serial_key AND w.held
                  ORDER BY w.serial_order LIMIT 1)
      AND NOT EXISTS (SELECT 1 FROM runpool.runs a
                      WHERE a.tenant = NEW.tenant AND a.serial_key = NEW.serial_key
                        AND a.status IN ('queued', 'running') AND NOT a.held);
    -- A worker ending a run claims again right away; anyone else (an API cancelling a run,
    -- say) rings the doorbell so the released run starts now rather than at the next poll.
    IF FOUND AND current_setting('runpool.session', true) IS DISTINCT FROM 'worker' THEN
        PERFORM pg_notify('runpool_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER serial_key_ended
AFTER UPDATE OF status ON runpool.runs
FOR EACH ROW
WHEN (NEW.serial_key IS NOT NULL
      AND NEW.status IN ('succeeded', 'failed', 'cancelled')
      AND OLD.status IN ('queued', 'running'))
EXECUTE FUNCTION runpool._serial_key_ended();

-- enqueue gains serial_key as its last parameter (existing calls keep working).
DROP FUNCTION runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text);

CREATE FUNCTION runpool.enqueue(
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
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    cfg runpool.config;
    -- clock_timestamp, not now(): runs enqueued in one transaction keep their order.
    available timestamptz := greatest(coalesce(enqueue.run_at, clock_timestamp()),
                                      clock_timestamp());
    new_id uuid;
    waits boolean := false;
    position bigint;
BEGIN
    IF enqueue.tenant IS NULL OR length(enqueue.tenant) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: tenant must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.handler IS NULL OR length(enqueue.handler) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: handler must be 1 to 200 characters'
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
    IF enqueue.idempotency_key IS NOT NULL AND length(enqueue.idempotency_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: idempotency_key must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.serial_key IS NOT NULL AND length(enqueue.serial_key) NOT BETWEEN 1 AND 200 THEN
        RAISE EXCEPTION 'runpool.enqueue: serial_key must be 1 to 200 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF enqueue.traceparent IS NOT NULL AND length(enqueue.traceparent) > 128 THEN
        RAISE EXCEPTION 'runpool.enqueue: traceparent is longer than 128 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO cfg FROM runpool.config;
    IF octet_length(coalesce(enqueue.input, '{}')::text) > cfg.max_input_bytes THEN
        RAISE EXCEPTION 'runpool.enqueue: input is % bytes, over the limit of % bytes',
            octet_length(enqueue.input::text), cfg.max_input_bytes
            USING ERRCODE = 'program_limit_exceeded';
    END IF;

    IF enqueue.serial_key IS NOT NULL THEN
        -- Under the key's lock, and in statements of their own: the check below sees every
        -- run of the key committed before the lock was granted.
        PERFORM runpool._lock_serial_key(enqueue.tenant, enqueue.serial_key);
        position := nextval('runpool.serial_order');
        waits := EXISTS (SELECT 1 FROM runpool.runs r
                         WHERE r.tenant = enqueue.tenant AND r.serial_key = enqueue.serial_key
                           AND r.status IN ('queued', 'running'));
    END IF;

    INSERT INTO runpool.tenants (tenant) VALUES (enqueue.tenant) ON CONFLICT DO NOTHING;
    INSERT INTO runpool.runs AS r (
        tenant, handler, input, priority, idempotency_key, available_at, rank,
        max_attempts, traceparent, serial_key, serial_order, held
    ) VALUES (
        enqueue.tenant, enqueue.handler, coalesce(enqueue.input, '{}'), enqueue.priority,
        enqueue.idempotency_key, available,
        extract(epoch FROM available) - enqueue.priority * cfg.aging_seconds,
        coalesce(enqueue.max_attempts, cfg.default_max_attempts), enqueue.traceparent,
        enqueue.serial_key, position, waits
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
    -- The doorbell carries no payload: identical notifications collapse within a transaction,
    -- so a bulk enqueue rings once.
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN new_id;
END
$$;

-- cancel_run: a cancelled run waiting behind its serial key stops waiting.
CREATE OR REPLACE FUNCTION runpool.cancel_run(run_id uuid, reason text DEFAULT NULL, tenant text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
BEGIN
    IF cancel_run.reason IS NOT NULL AND length(cancel_run.reason) > 2000 THEN
        RAISE EXCEPTION 'runpool.cancel_run: reason is longer than 2000 characters'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO run FROM runpool.runs r WHERE r.id = cancel_run.run_id FOR UPDATE;
    -- Another tenant's run answers exactly like a missing one: no existence leak.
    IF NOT FOUND OR (cancel_run.tenant IS NOT NULL AND run.tenant <> cancel_run.tenant) THEN
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

-- retry_run: a revived keyed run rejoins its key at the back.
CREATE OR REPLACE FUNCTION runpool.retry_run(run_id uuid)
RETURNS text
LANGUAGE plpgsql SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
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
        PERFORM runpool._lock_serial_key(run.tenant, run.serial_key);
        position := nextval('runpool.serial_order');
        waits := EXISTS (SELECT 1 FROM runpool.runs r
                         WHERE r.tenant = run.tenant AND r.serial_key = run.serial_key
                           AND r.status IN ('queued', 'running') AND r.id <> run.id);
    END IF;
    SELECT aging_seconds INTO step FROM runpool.config;
    UPDATE runpool.runs r SET
        status = 'queued', attempt_offset = r.attempt, available_at = clock_timestamp(),
        rank = extract(epoch FROM clock_timestamp()) - r.priority * step,
        finished_at = NULL, lease_expires_at = NULL, worker_id = NULL,
        cancel_requested_at = NULL, cancel_reason = NULL,
        serial_order = coalesce(position, r.serial_order), held = waits
    WHERE r.id = run.id;
    INSERT INTO runpool.run_events (run_id, kind, attempt, detail)
    VALUES (run.id, 'retried', run.attempt, jsonb_build_object('from', run.status));
    PERFORM pg_notify('runpool_wakeup', '');
    RETURN 'queued';
END
$$;

-- explain_run: a held run names the run it waits for.
CREATE OR REPLACE FUNCTION runpool.explain_run(run_id uuid)
RETURNS jsonb
LANGUAGE plpgsql STABLE SECURITY DEFINER SET search_path = runpool, pg_catalog, pg_temp
AS $$
#variable_conflict use_column
DECLARE
    run runpool.runs;
    quota integer;
    live integer;
    ahead bigint;
    blocker uuid;
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
        'attempts_left', run.max_attempts - (run.attempt - run.attempt_offset),
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

    SELECT coalesce(t.max_running, c.default_quota) INTO quota
    FROM runpool.config c LEFT JOIN runpool.tenants t ON t.tenant = run.tenant;
    SELECT count(*) INTO live FROM runpool.runs l
    WHERE l.tenant = run.tenant AND l.status = 'running' AND l.lease_expires_at > now();
    IF quota IS NOT NULL AND live >= quota THEN
        reasons := reasons || jsonb_build_array(CASE WHEN quota = 0
            THEN format('tenant %s is paused (quota 0)', run.tenant)
            ELSE format('tenant %s at quota %s/%s', run.tenant, live, quota) END);
    END IF;
    IF run.held THEN
        SELECT b.id INTO blocker FROM runpool.runs b
        WHERE b.tenant = run.tenant AND b.serial_key = run.serial_key
          AND b.status IN ('queued', 'running') AND NOT b.held;
        reasons := reasons || jsonb_build_array(
            format('waiting for run %s of the same serial key %s', blocker, run.serial_key));
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
        'tenant_running', live, 'tenant_quota', quota,
        'runs_ahead', ahead, 'runs_ahead_capped', ahead >= 10000,
        'held_by', reasons,
        'summary', CASE WHEN jsonb_array_length(reasons) = 0
            THEN format('waiting for a free slot; %s%s runs ahead of it', ahead,
                        CASE WHEN ahead >= 10000 THEN '+' ELSE '' END)
            ELSE reasons ->> 0 END);
END
$$;

REVOKE ALL ON FUNCTION
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text),
    runpool._lock_serial_key(text, text),
    runpool._serial_key_ended()
FROM PUBLIC;
GRANT EXECUTE ON FUNCTION
    runpool.enqueue(text, text, jsonb, integer, text, timestamptz, integer, text, text)
TO runpool_api, runpool_worker;
GRANT USAGE ON SEQUENCE runpool.serial_order TO runpool_worker;
